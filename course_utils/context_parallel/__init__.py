"""Context parallelism: attention over a sequence sharded across ranks.

- :mod:`.softmax`: attention in blocks, merged by the online softmax (log-sum-exp);
- :mod:`.layout`: which tokens each rank holds (contiguous or zig-zag) and the causal work;
- :mod:`.comm`: the ring's batched point-to-point passes, Ulysses' all-to-alls, the all-gather;
- :mod:`.ring`: :func:`ring_attention`, forward and backward (dK/dV back around the ring);
- :mod:`.ulysses`: :func:`ulysses_attention` (sequence ↔ heads) and :func:`allgather_attention`;
- :mod:`.apply`: :func:`apply_cp` on :class:`course_utils.models.GPT`;
- :mod:`.parity`: its parity worker against one process;
- :mod:`.measure`: the values each method sends, per rank and layer.

Taught in notebook 09.
"""

from .apply import apply_cp
from .layout import positions, shard, unshard, work_per_rank
from .measure import values_per_rank
from .ring import ring_attention
from .softmax import attention, block_attention, merge
from .ulysses import allgather_attention, ulysses_attention

__all__ = [
    "allgather_attention",
    "apply_cp",
    "attention",
    "block_attention",
    "merge",
    "positions",
    "ring_attention",
    "shard",
    "ulysses_attention",
    "unshard",
    "values_per_rank",
    "work_per_rank",
]
