"""Tensor parallelism (Megatron-LM): the layers, their communication, and ``apply_tp``.

- :mod:`.comm`: ``f``, ``g`` and sequence parallelism's all-gather / reduce-scatter pair;
- :mod:`.layers`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`;
- :mod:`.loss`: :func:`vocab_parallel_cross_entropy`, which never gathers the logits;
- :mod:`.apply`: :func:`apply_tp` shards a single-device model from a plan table
  (:func:`gpt_plan` for :class:`course_utils.models.GPT`);
- :mod:`.measure`: collectives counted, bytes and activation memory against the papers;
- :mod:`.run`: ``torch.distributed.tensor.parallel`` on the same model, and :func:`shard_like`;
- :mod:`.parity`: the parity worker against one process.

Taught in notebook 06; the 3D notebook (07) reuses it.
"""

from .apply import STYLES, PlanError, apply_tp, gpt_plan
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "PlanError",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_tp",
    "gpt_plan",
    "vocab_parallel_cross_entropy",
]
