"""3D parallelism: data × pipeline × tensor parallel on one GPT, checked against one process.

Each dimension runs over its own process group (:class:`~course_utils.parallel3d.dims.ParallelDims`):

- **TP** (notebook 06): inside a pipeline stage, :func:`~course_utils.tensor_parallel.apply_tp`
  cuts every block's ``qkv``/``up`` column-wise and ``proj``/``down`` row-wise, the embedding by
  vocabulary and the head column-wise; the loss is the vocabulary-parallel cross-entropy. Its
  all-reduces run over the TP group.
- **PP** (notebook 05): the GPT's blocks are split into ``pp`` contiguous stages (:class:`GPTStage`;
  the first also holds the embeddings, the last the final LayerNorm and the head), and the
  course's 1F1B or GPipe schedule (:class:`~course_utils.pipeline.schedules.StageRunner`) moves
  micro-batches between the ranks of the PP group. The TP rank ``t`` of stage ``s`` sends to the TP
  rank ``t`` of stage ``s+1``: activations between stages are whole (after TP's all-reduce), so
  every TP rank of a stage holds the same tensor, and each sends its own copy.
- **DP** (notebooks 03, 08): each DP replica trains on its slice of the global batch; gradients are
  averaged over the DP group after the pipeline's flush (``dp_method="ddp"``), or reduce-scattered
  into ZeRO-1 shards (``dp_method="zero1"``, :class:`~course_utils.zero.ShardedOptimizer`).

:func:`compose_worker` trains this and, on every rank, one single-process copy of the model on the
whole batch, and compares every parameter shard with the same slice of the reference (through
:func:`course_utils.parity.train_beside_reference`). :func:`torch_compose_worker` does the same with torch's own pieces on a named ``DeviceMesh``:
``parallelize_module`` for TP, ``fully_shard`` (FSDP2) over DP, ``torch.distributed.pipelining``
over PP. Taught in notebook 07; ``python -m course_utils bench 3d`` measures it.

- :mod:`.dims`: :class:`ParallelDims`, rank → (dp, pp, tp) coordinates, groups and ``DeviceMesh``;
- :mod:`.stages`: the blocks of each stage, :class:`GPTStage`, its TP plan, shape checks, batches;
- :mod:`.step`: the course's own training step (schedule, DP average or ZeRO-1, optimizer);
- :mod:`.parity`: :func:`compose_worker`, beside one process;
- :mod:`.native`: :func:`torch_compose_worker`, torch's DeviceMesh, FSDP2 and pipelining;
- :mod:`.decide`: which parallelism to use (DDP, ZeRO/FSDP, TP, PP), the lectures' decision
  summary with the planner's (:mod:`course_utils.plan`) memory and time (notebook 08).
"""

from .decide import decide
from .dims import Groups, ParallelDims
from .native import torch_compose_worker, torch_stage_plan
from .parity import compose_worker
from .stages import GPTStage, batches, check_shape, make_stage, stage_bounds, stage_plan
from .step import DP_METHODS, average_gradients, modelled

__all__ = [
    "DP_METHODS",
    "GPTStage",
    "Groups",
    "ParallelDims",
    "batches",
    "check_shape",
    "average_gradients",
    "compose_worker",
    "decide",
    "make_stage",
    "modelled",
    "stage_bounds",
    "stage_plan",
    "torch_compose_worker",
    "torch_stage_plan",
]
