"""``python -m course_utils bench tp``: the from-scratch TP transformer layer against DTensor TP.

One :class:`~course_utils.models.Block` (a middle layer: its input needs a gradient), sharded over
``t`` ranks two ways with the same Megatron-LM plan (:data:`PLAN`):

- ours: :func:`course_utils.tensor_parallel.apply_tp`;
- torch: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a 1-D mesh.

Time: a training step (forward, backward, SGD step), median of the timed steps after warm-up, the
slowest rank's; the two run as alternating launches so that machine noise hits both alike.
``t = 1`` is the plain single-device layer (a 1-rank launch). Memory: the bytes autograd keeps for
backward per rank (:func:`course_utils.measure.saved_activations`), with dropout on, against
Korthikanti et al. 2022, Table 2 re-derived for float32
(:func:`~course_utils.tensor_parallel.measure.activation_bytes_per_layer`).

    python -m course_utils bench tp --world-sizes 1 2 4 --rounds 5
"""

from __future__ import annotations

import statistics

import torch
from torch.nn import functional as F

from ..launcher import launch
from ..measure import saved_activations, time_steps
from ..models import Block, GPTConfig
from ..tensor_parallel.measure import activation_bytes_per_layer, dropout_mask_bytes
from . import provenance

PLAN = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
"""Megatron-LM's plan for one layer: two all-reduces forward, two backward."""

DEFAULTS = {"d_model": 256, "n_heads": 4, "seq_len": 128, "batch": 4, "steps": 10, "warmup": 3}
DROPOUT = 0.1  # the memory runs only: dropout's masks are part of Table 2
LR = 0.01
# The SGD step is written out rather than taken from torch.optim: constructing a torch.optim
# optimizer imports torch._dynamo, about 7 s per rank on 2 loaded cores, on every launch.


def _config(d_model: int, n_heads: int, seq_len: int, dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_layers=1, dropout=dropout)


def _parallelize(block: Block, impl: str, ctx) -> Block:
    """Shard ``block`` over every rank with ``impl`` (``"ours"`` or ``"torch"``); t=1: as it is."""
    if ctx.world_size == 1:
        return block
    if impl == "ours":
        from ..tensor_parallel import apply_tp

        return apply_tp(block, PLAN)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    return parallelize_module(block, mesh, {name: styles[s]() for name, s in PLAN.items()})


def step_time_worker(
    ctx,
    impl: str,
    d_model: int,
    n_heads: int,
    seq_len: int,
    batch: int,
    steps: int,
    warmup: int,
) -> float:
    """Median seconds per training step of one sharded layer on this rank (run under ``launch``)."""
    torch.manual_seed(0)
    block = _parallelize(Block(_config(d_model, n_heads, seq_len)).to(ctx.device), impl, ctx)
    params = list(block.parameters())
    x = torch.randn(batch, seq_len, d_model, device=ctx.device, requires_grad=True)  # (B, T, h)
    y = torch.randn(batch, seq_len, d_model, device=ctx.device)

    def step():
        x.grad = None
        loss = F.mse_loss(block(x), y)
        loss.backward()  # the input's gradient too: f's all-reduce runs, as in a middle layer
        with torch.no_grad():  # SGD, as torch.optim.SGD does it on the CPU: one add_ per parameter
            for p in params:
                p.add_(p.grad, alpha=-LR)
                p.grad = None

    return statistics.median(time_steps(step, steps, warmup, ctx.device))


def activation_worker(ctx, d_model: int, n_heads: int, seq_len: int, batch: int) -> int:
    """Bytes one forward of our sharded layer (dropout on) keeps for backward on this rank."""
    torch.manual_seed(0)
    block = Block(_config(d_model, n_heads, seq_len, DROPOUT)).to(ctx.device)
    block = _parallelize(block, "ours", ctx)
    x = torch.randn(batch, seq_len, d_model, device=ctx.device)  # (B, T, h)
    with saved_activations() as mem:
        block(x)
    return mem["bytes"]


def formula_bytes(t: int, d_model: int, n_heads: int, seq_len: int, batch: int, device) -> dict:
    """Table 2 for float32 activations and this device's dropout masks, and what it leaves out:
    each LayerNorm also keeps a mean and a 1/std per token (2 LayerNorms, replicated over ranks)."""

    table2 = activation_bytes_per_layer(
        seq_len, batch, d_model, n_heads, t=t, act_bytes=4, mask_bytes=dropout_mask_bytes(device)
    )
    return {"table2": int(table2), "layernorm_stats": 2 * 2 * seq_len * batch * 4}


def run(world_sizes=(1, 2, 4), rounds: int = 5, device: str = "auto", **sizes) -> dict:
    """Time every ``t`` in ``world_sizes`` ``rounds`` times (alternating ours and torch); measure
    activation memory once per ``t``. Returns raw samples (ms), medians and ratios."""

    cfg = {**DEFAULTS, **sizes}
    bad = [t for t in world_sizes if t < 1 or cfg["n_heads"] % t]
    if bad:
        raise ValueError(
            f"world sizes {bad} do not split n_heads={cfg['n_heads']} heads evenly: pick tensor-"
            f"parallel degrees that divide {cfg['n_heads']}"
        )
    shape = {k: cfg[k] for k in ("d_model", "n_heads", "seq_len", "batch")}
    impls = {t: ("single",) if t == 1 else ("ours", "torch") for t in world_sizes}
    samples = {t: {impl: [] for impl in impls[t]} for t in world_sizes}
    backend = None
    for i in range(rounds):
        for t in world_sizes:
            for impl in impls[t] if i % 2 == 0 else impls[t][::-1]:
                res = launch(
                    step_time_worker, t, impl=impl, device=device, echo=False, progress=False, **cfg
                )
                samples[t][impl].append(max(res.results) * 1e3)  # the slowest rank sets the pace
                backend = res.backend
    rows = []
    for t in world_sizes:
        res = launch(activation_worker, t, device=device, echo=False, progress=False, **shape)
        med = {impl: statistics.median(v) for impl, v in samples[t].items()}
        rows.append(
            {
                "t": t,
                "median_step_ms": med,
                "samples_ms": samples[t],
                "ratio": med["torch"] / med["ours"] if t > 1 else None,
                "activation_bytes": res.results,  # per rank
                "formula_bytes": formula_bytes(t, device=res.device, **shape),
            }
        )
    return {
        "world_sizes": list(world_sizes),
        "rounds": rounds,
        "backend": backend,
        "rows": rows,
        "config": {**cfg, "dtype": "float32", "dropout_for_memory": DROPOUT, "plan": PLAN},
        **provenance(),
    }


def table(r: dict) -> str:
    c = r["config"]
    mib = 2**20
    out = [
        f"one transformer layer (h={c['d_model']}, a={c['n_heads']}, s={c['seq_len']}, "
        f"b={c['batch']}, float32), {r['backend']}, {r['rounds']} alternating rounds, "
        f"{c['warmup']} warm-up + {c['steps']} timed steps, {r['machine']}, {r['date']}",
        "",
        "| t | from-scratch `apply_tp` ms | torch DTensor TP ms | throughput ours / torch "
        "(target >= 0.9) | activations / rank MiB | Table 2 + LN stats MiB | measured - formula B |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        med, s = row["median_step_ms"], row["samples_ms"]
        f = row["formula_bytes"]
        want = f["table2"] + f["layernorm_stats"]
        got = max(row["activation_bytes"])
        ours = "single" if row["t"] == 1 else "ours"
        mine = f"{med[ours]:.1f} ({min(s[ours]):.1f}-{max(s[ours]):.1f})"
        if row["t"] == 1:
            theirs, ratio = "(single device)", "-"
        else:
            theirs = f"{med['torch']:.1f} ({min(s['torch']):.1f}-{max(s['torch']):.1f})"
            ratio = f"**{row['ratio']:.2f}x**"
        out.append(
            f"| {row['t']} | {mine} | {theirs} | {ratio} | {got / mib:.2f} | {want / mib:.2f} | "
            f"{got - want} |"
        )
    return "\n".join(out)
