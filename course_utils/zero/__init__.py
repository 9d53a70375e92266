"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards the model states.

- :mod:`.memory`: :func:`model_state_bytes` (the paper's formulas) and
  :func:`count_model_states` (what a rank really holds);
- :mod:`.flat`: flat buffers padded so that every rank holds exactly ``1/n``;
- :mod:`.stage1`: :class:`ShardedOptimizer` (P_os; torch's ``ZeroRedundancyOptimizer`` interface);
- :mod:`.stage2`: :class:`ShardedGradientOptimizer` (P_os+g; gradients reduce-scattered in buckets
  during backward);
- :mod:`.stage3`: :class:`ShardedModel` (P_os+g+p; parameters gathered one unit at a time);
- :mod:`.traffic`: the bytes each stage sends, counted where it calls a collective;
- :mod:`.run`: every stage, torch's ``ZeroRedundancyOptimizer`` and FSDP2 behind one ``wrap``, the
  memory worker, and the decision calculator;
- :mod:`.parity`: the parity worker for each of them against one process.

Taught in notebook 08.
"""

from .memory import STAGES, ModelStates, count_model_states, model_state_bytes
from .stage1 import ShardedOptimizer
from .stage2 import ShardedGradientOptimizer
from .stage3 import ShardedModel

__all__ = [
    "STAGES",
    "ModelStates",
    "ShardedGradientOptimizer",
    "ShardedModel",
    "ShardedOptimizer",
    "count_model_states",
    "model_state_bytes",
]
