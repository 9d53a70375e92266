"""Which parallelism to use: the lectures' decision summary, with the memory arithmetic done.

The CSC lecture's rules, in the order they are asked:

1. the model states fit on one GPU → **DDP** (fastest: no extra communication);
2. they fit once sharded over the data-parallel GPUs → **ZeRO / FSDP**, the lowest stage that fits
   (stage 1 and 2 cost no extra communication, stage 3 costs 1.5×);
3. the largest layer does not fit on one GPU, even with everything else sharded → **tensor
   parallelism** inside a node (notebook 06);
4. no fast link between nodes → **pipeline parallelism** across them (notebook 05): it sends only
   activations at stage boundaries, point to point.

:func:`decide` prints per-GPU model-state memory for DDP and ZeRO-1/2/3 (:func:`model_state_bytes`)
plus the activations and a reserve the caller gives, and says which fit.
"""

from __future__ import annotations

from .memory import STAGES, model_state_bytes

NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}


def decide(
    num_params: float,
    n_gpus: int,
    gpu_bytes: float,
    largest_layer_params: float | None = None,
    activation_bytes: float = 0.0,
    reserve: float = 0.1,
    fast_internode: bool = True,
    gpus_per_node: int = 8,
    k: float = 12,
) -> dict:
    """Per-GPU bytes for DDP and each ZeRO stage, which fit, and the advice.

    ``gpu_bytes``: one GPU's memory; ``reserve``: the fraction kept free for the allocator, NCCL
    buffers and fragmentation; ``activation_bytes``: per GPU, at the chosen micro-batch;
    ``largest_layer_params``: ZeRO-3 gathers a whole layer (unit) at once, in 16 bits, and keeps
    its gradient until it is reduce-scattered, so it must fit too. ``k = 12``: mixed-precision Adam.
    """
    if n_gpus < 1 or gpu_bytes <= 0 or num_params <= 0:
        raise ValueError("num_params, n_gpus and gpu_bytes must be positive")
    usable = gpu_bytes * (1 - reserve)
    rows = []
    for stage in STAGES:
        states = model_state_bytes(num_params, n_gpus, stage, k=k)
        extra = 4 * largest_layer_params if (stage == 3 and largest_layer_params) else 0.0
        need = states + activation_bytes + extra
        rows.append({"stage": stage, "name": NAMES[stage], "bytes": need, "fits": need <= usable})
    fitting = [r for r in rows if r["fits"]]
    advice = []
    layer = largest_layer_params
    if fitting:
        best = fitting[0]
        if best["stage"] == 0:
            advice.append("the model states fit on one GPU: DDP")
        else:
            cost = "1.5× DDP's communication" if best["stage"] == 3 else "DDP's communication"
            advice.append(f"{best['name']}: the lowest stage that fits ({cost})")
    elif layer and 4 * layer + activation_bytes > usable:
        advice.append("the largest layer does not fit on one GPU: tensor parallelism inside a node")
    else:
        states = model_state_bytes(num_params, 1, 0, k=k)
        room = usable - activation_bytes - (4 * layer if layer else 0.0)  # per GPU, for shards
        if room <= 0 or states > n_gpus * room:
            need = f"at least {-(-states // room):.0f} GPUs" if room > 0 else "more memory per GPU"
            advice.append(
                f"the model states ({states / 1e9:,.0f} GB) do not fit in {n_gpus} GPUs beside "
                f"the activations and the gathered layer: {need}, or offload the optimizer "
                "state to CPU memory (ZeRO-Offload)"
            )
        else:
            advice.append(
                "the activations do not fit beside the sharded states: activation checkpointing, a "
                "smaller micro-batch, or tensor and sequence parallelism"
            )
    if not fast_internode and n_gpus > gpus_per_node:
        advice.append(
            "no fast link between nodes: keep data-parallel/ZeRO traffic inside a node and put "
            "pipeline stages across nodes"
        )
    return {"rows": rows, "usable_bytes": usable, "advice": advice}


def table(result: dict) -> str:
    lines = [f"{'':14} {'GB per GPU':>11}  fits in {result['usable_bytes'] / 1e9:.0f} GB?"]
    for r in result["rows"]:
        lines.append(f"{r['name']:14} {r['bytes'] / 1e9:>11.1f}  {'yes' if r['fits'] else 'no'}")
    lines += ["→ " + a for a in result["advice"]]
    return "\n".join(lines)
