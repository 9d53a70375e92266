"""The 3D-parallelism planner: memory and step time of every (dp, pp, tp, ZeRO) layout, ranked.

    from course_utils.plan import H100_80GB, LLAMA3_70B, explain, plan, table
    preds = plan(LLAMA3_70B, H100_80GB, 64)
    print(table(preds, limit=5)); print(explain(preds[0], LLAMA3_70B, H100_80GB))

Taught in notebook 07; ``python -m course_utils bench 3d`` checks it against measurement. Pure
arithmetic, one file per part:

- :mod:`.model`: the model (GPT or Llama-style: any MLP width, SwiGLU, grouped-query attention,
  tied or untied embeddings, the vocabulary padded as Megatron pads it), the cluster (A100 and
  H100 nodes) and a layout; parameters of a shard and FLOPs of a step;
- :mod:`.memory`: ZeRO's model states of one shard and the activations in flight (Korthikanti
  et al.'s count with FlashAttention, selective or full recomputation, sequence parallelism, the
  logits);
- :mod:`.step_time`: compute at a compute-only efficiency that falls for small micro-batches, the
  bubble, and each dimension's communication, hidden behind compute where it can be;
- :mod:`.layouts`: every valid layout, placed on the links, predicted and ranked;
- :mod:`.explain`: a prediction in words, a table of many;
- :mod:`.published`: Megatron-LM's Table 1 and the layouts of public runs, to check against;
- :mod:`.calibrate`: a link's ``α`` and ``β`` from measured collectives.

The formulas earlier notebooks taught are imported, not re-derived: ZeRO's model states (08),
Korthikanti's activations and Megatron's TP bytes (06), the bubble (05), the α–β ring costs (03).
"""

from .calibrate import fit_link
from .explain import explain, table
from .layouts import Prediction, best_of, placement, plan, predict, problems, valid_choices
from .memory import layer_activation_bytes
from .model import (
    A100_80GB,
    H100_80GB,
    RECOMPUTE,
    Choice,
    Cluster,
    Transformer,
    flops_per_step,
    shard_params,
)
from .published import (
    GPT3_175B,
    LLAMA3_8B,
    LLAMA3_70B,
    NARAYANAN_TABLE1,
    PUBLISHED_RUNS,
    PublishedRun,
    compare_narayanan,
    measured_step_s,
    narayanan_model,
    paper_layout,
)

__all__ = [
    "A100_80GB",
    "GPT3_175B",
    "H100_80GB",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "NARAYANAN_TABLE1",
    "PUBLISHED_RUNS",
    "RECOMPUTE",
    "Choice",
    "Cluster",
    "Prediction",
    "PublishedRun",
    "Transformer",
    "best_of",
    "compare_narayanan",
    "explain",
    "fit_link",
    "flops_per_step",
    "layer_activation_bytes",
    "measured_step_s",
    "narayanan_model",
    "paper_layout",
    "placement",
    "plan",
    "predict",
    "problems",
    "shard_params",
    "table",
    "valid_choices",
]
