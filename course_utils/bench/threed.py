"""``python -m course_utils bench 3d``: the planner's predictions against measurement, on 8 ranks.

For every (dp, pp, tp) layout of 8 ranks that the model allows, the course's own 3D composition
(:func:`course_utils.parallel3d.compose_worker`: TP from notebook 06, 1F1B from 05, DP from 03)
trains a GPT for a few steps. Per layout it reports the measured step time (the slowest rank's
median) and peak memory per rank (model states plus the activations the schedule held, both
counted, not read from the allocator), beside :func:`course_utils.plan.predict`'s numbers and the
relative errors. Targets (issue): step time within 20%, memory within 10%.

The planner is calibrated for this machine first (:func:`calibrate`), as notebook 07 teaches:

- the link: ``α`` and ``β`` fitted (:func:`course_utils.plan.fit_link`) to all-reduce times in
  groups of 2 while all 8 ranks communicate at once (:func:`link_worker`, shaped like a
  ``bench collectives`` report), as the groups of a 3D run do;
- compute: FLOP/s per rank while all 8 ranks run one transformer layer's forward and backward at
  once (on CPUs the ranks share the cores; on GPUs each rank has its own).

Every rank is on one node here, so every dimension uses the same link.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..comm.model import AlphaBeta
from ..launcher import launch
from ..measure import synchronize
from ..modelled import describe
from ..models import Block, GPTConfig
from ..parallel3d import compose_worker
from ..plan import Choice, Cluster, Transformer, fit_link, placement, predict, valid_choices
from . import provenance

DEFAULTS = {"vocab": 256, "seq_len": 64, "d_model": 128, "n_heads": 8, "n_layers": 8,
            "dropout": 0.1, "global_batch": 16, "micro_batches": 4, "steps": 4, "warmup": 1}  # fmt: skip
WORLD = 8


def _cfg(c: dict) -> GPTConfig:
    return GPTConfig(vocab=c["vocab"], seq_len=c["seq_len"], d_model=c["d_model"],
                     n_heads=c["n_heads"], n_layers=c["n_layers"], dropout=c["dropout"])  # fmt: skip


def shapes(c: dict, world: int = WORLD) -> list[tuple[int, int, int]]:
    """Every (dp, pp, tp) of ``world`` ranks the model and batch allow, with ``c``'s ``m``."""
    model = Transformer.from_gpt_config(_cfg(c), c["global_batch"])
    found = {
        (ch.dp, ch.pp, ch.tp)
        for ch in valid_choices(model, world, zero_stages=(0,), micro_batches=[c["micro_batches"]])
    }
    return sorted(found, key=lambda s: (-s[0], -s[1]))


def layer_flops(b: int, s: int, h: int, ffn_mult: int = 4) -> float:
    """Forward and backward FLOPs of one transformer layer on ``b`` sequences (3 × forward;
    Narayanan et al. 2021, eq. 3's per-layer term)."""
    return 3 * ((8 + 4 * ffn_mult) * b * s * h * h + 4 * b * s * s * h)


def compute_worker(ctx, b: int, repeats: int = 5, **c) -> float:
    """FLOP/s of one layer's forward and backward on this rank while every rank does the same."""
    cfg = _cfg(c)
    torch.manual_seed(0)
    block = Block(cfg).to(ctx.device)
    x = torch.randn(b, cfg.seq_len, cfg.d_model, device=ctx.device, requires_grad=True)
    block(x).sum().backward()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(ctx.device)  # the clock starts when the device is idle too
        torch.distributed.barrier()
        synchronize(ctx.device)
        t0 = time.perf_counter()
        block(x).sum().backward()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return layer_flops(b, cfg.seq_len, cfg.d_model, cfg.ffn_mult) / statistics.median(times)


def link_worker(ctx, group_size: int = 2, sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22),
                iters: int = 10) -> dict:  # fmt: skip
    """All-reduce times in groups of ``group_size`` while every group runs at once, as a 3D run's
    TP or DP groups do: a ``bench collectives``-shaped report for :func:`~course_utils.plan.fit_link`."""
    import torch.distributed as dist

    group, _ = dist.new_subgroups(group_size)
    rows = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, device=ctx.device)
        for _ in range(2):
            dist.all_reduce(buf, group=group)
        synchronize(ctx.device)
        dist.barrier()
        synchronize(ctx.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf, group=group)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t = torch.tensor(
            [(time.perf_counter() - t0) / iters], dtype=torch.float64, device=ctx.device
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append({"op": "all_reduce", "bytes": nbytes, "time_us": t.item() * 1e6})
    return {"rows": rows, "world_size": group_size, "backend": ctx.backend}


def calibrate(
    c: dict | None = None, world: int = WORLD, device: str = "auto", tflops: float | None = None
) -> dict:
    """Measure this machine for the planner: a link's ``α``/``β`` and FLOP/s per rank (with
    ``tflops``, compute is modelled: the rate is the declared one and only the link is measured)."""

    c = {**DEFAULTS, **(c or {})}
    kw = {"device": device, "echo": False, "progress": False}
    report = launch(link_worker, world, **kw).results[0]
    link = fit_link(report)
    b = c["global_batch"] // c["micro_batches"]  # the micro-batch of a dp=1 layout
    if tflops is None:
        res = launch(compute_worker, world, b=b, **kw, **c)
        rate = statistics.median(res.results)
    else:
        rate = tflops * 1e12
    return {"alpha": link.alpha, "beta": link.beta, "flops_per_rank": rate, "b": b,
            "backend": report["backend"], "tflops": tflops}  # fmt: skip


def cluster_of(cal: dict, world: int = WORLD) -> Cluster:
    """This machine as the planner sees it: one node of ``world`` ranks, the measured rate."""

    link = AlphaBeta(cal["alpha"], cal["beta"])
    return Cluster(gpus_per_node=world, memory_bytes=64e9, peak_flops=cal["flops_per_rank"],
                   intra=link, inter=link, efficiency=1.0, name="this machine")  # fmt: skip


def predicted(shape, c: dict, cluster: Cluster, device_type: str = "cpu"):
    """The planner's prediction for one layout, with the dtypes of :func:`measure_worker`:
    float32 everywhere, SGD without momentum (``K = 0``), dropout masks of 4 bytes on the CPU
    (1 on a GPU), and the composition's own choices (no FlashAttention, no SP, no overlap)."""
    dp, pp, tp = shape
    model = Transformer.from_gpt_config(_cfg(c), c["global_batch"])
    mask = 4 if device_type == "cpu" else 1
    return predict(
        model, cluster, Choice(dp, pp, tp, 0, c["micro_batches"]), param_bytes=4, grad_bytes=4,
        k=0, act_bytes=4, mask_bytes=mask if c["dropout"] > 0 else 0,
        # as the course's composition runs: scores materialised, no sequence parallelism, each TP
        # rank sending the whole activation to the next stage, the DP average after the flush
        attention="materialized", sequence_parallel=False, pp_scatter_gather=False, overlap=False,
    )  # fmt: skip


def measure_worker(ctx, dp: int, pp: int, tp: int, tflops: float | None = None, **c) -> dict:
    """One layout trained for ``warmup + steps`` steps: this rank's median step and peak bytes
    (``tflops``: under modelled compute at that speed)."""

    r = compose_worker(
        ctx, dp, pp, tp, cfg=_cfg(c), global_batch=c["global_batch"],
        micro_batches=c["micro_batches"], steps=c["warmup"] + c["steps"], dtype=torch.float32,
        reference=False, compute=tflops,
    )  # fmt: skip
    return {
        "s": statistics.median(r["step_s"][c["warmup"] :]),
        "cpu_s": statistics.median(r["cpu_s"][c["warmup"] :]),
        "bytes": r["states_bytes"] + r["peak_activation_bytes"],
        "states": r["states_bytes"],
        "activations": r["peak_activation_bytes"],
    }


def run(
    rounds: int = 1, device: str = "auto", only=None, tflops: float | None = None, **sizes
) -> dict:
    """Calibrate, then measure every layout (``only``: a list of (dp, pp, tp)) ``rounds`` times.

    ``tflops``: time the layouts under modelled compute
    (:class:`~course_utils.modelled.ModelledCompute`) at this many TFLOP/s per rank, and give the
    planner the same rate at full efficiency; only the link is calibrated, the communication and
    the schedule are real. Without it, compute is real and the planner gets the measured rate."""

    c = {**DEFAULTS, **sizes}
    cal = calibrate(c, device=device, tflops=tflops)
    cluster = cluster_of(cal)
    todo = [tuple(s) for s in only] if only else shapes(c)
    samples = {s: [] for s in todo}
    cpu = {s: [] for s in todo}
    last, device_type = {}, "cpu"
    for i in range(rounds):
        for s in todo if i % 2 == 0 else todo[::-1]:
            dp, pp, tp = s
            res = launch(measure_worker, WORLD, dp=dp, pp=pp, tp=tp, tflops=tflops,
                         device=device, echo=False, progress=False, **c)  # fmt: skip
            samples[s].append(max(r["s"] for r in res.results) * 1e3)
            cpu[s].append(max(r["cpu_s"] for r in res.results) * 1e3)
            last[s] = res.results
            device_type = "cuda" if res.backend == "nccl" else "cpu"
    rows = []
    for s in todo:
        p = predicted(s, c, cluster, device_type)
        fullest = max(last[s], key=lambda r: r["bytes"])
        ms = statistics.median(samples[s])
        rows.append({
            "dp": s[0], "pp": s[1], "tp": s[2], "measured_ms": ms, "samples_ms": samples[s],
            "cpu_ms": statistics.median(cpu[s]),
            "predicted_ms": p.time["total"] * 1e3,
            "terms_ms": {k: v * 1e3 for k, v in p.time.items() if k != "total"},
            "measured_bytes": fullest["bytes"], "measured_states": fullest["states"],
            "measured_activations": fullest["activations"],
            "predicted_bytes": p.memory["total"], "predicted_states": p.memory["model_states"],
            "predicted_activations": p.memory["activations"],
            "time_error": p.time["total"] * 1e3 / ms - 1,
            "memory_error": p.memory["total"] / fullest["bytes"] - 1,
        })  # fmt: skip
    modelled = describe(tflops, cal["backend"]) if tflops is not None else None
    return {"rounds": rounds, "calibration": cal, "config": c, "rows": rows, "modelled": modelled,
            "links": placement(Choice(1, 1, 1), WORLD), **provenance()}  # fmt: skip


def table(r: dict) -> str:
    c, cal = r["config"], r["calibration"]
    rate = (
        f"{cal['flops_per_rank'] / 1e9:.2f} GFLOP/s per rank, declared (compute modelled)"
        if r.get("modelled")
        else f"{cal['flops_per_rank'] / 1e9:.2f} GFLOP/s per rank with {WORLD} ranks computing at once"
    )
    out = [r["modelled"]] if r.get("modelled") else []
    out += [
        f"GPT (L={c['n_layers']}, h={c['d_model']}, a={c['n_heads']}, s={c['seq_len']}, "
        f"V={c['vocab']}, dropout {c['dropout']}), global batch {c['global_batch']}, "
        f"m={c['micro_batches']}, float32, SGD; {WORLD} ranks, {cal['backend']}, {r['machine']}, "
        f"{r['date']}",
        f"calibration: α = {cal['alpha'] * 1e6:.0f} µs, β = {cal['beta'] / 1e9:.2f} GB/s "
        f"(all-reduce in 4 concurrent groups of 2); {rate}",
        "",
        "| dp | pp | tp | step ms measured | predicted | error | memory MiB counted | "
        "predicted | error | predicted terms (compute, bubble, tp, pp, dp) ms | CPU work ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    hits = [0, 0]
    for row in r["rows"]:
        t = row["terms_ms"]
        terms = ", ".join(
            f"{t[k]:.0f}" for k in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm")
        )
        te, me = row["time_error"], row["memory_error"]
        hits[0] += abs(te) <= 0.2
        hits[1] += abs(me) <= 0.1
        out.append(
            f"| {row['dp']} | {row['pp']} | {row['tp']} | {row['measured_ms']:.0f} | "
            f"{row['predicted_ms']:.0f} | {te:+.0%} | {row['measured_bytes'] / 2**20:.2f} | "
            f"{row['predicted_bytes'] / 2**20:.2f} | {me:+.0%} | {terms} | {row['cpu_ms']:.0f} |"
        )
    n = len(r["rows"])
    out.append(
        f"\nwithin target: step time {hits[0]}/{n} layouts (±20%), memory {hits[1]}/{n} (±10%). "
        "CPU work: the busiest rank's process time per step (its real work, gloo's threads and "
        "the mode's bookkeeping included; not its waits or sleeps), which the planner does not count"
    )
    return "\n".join(out)


__all__ = ["DEFAULTS", "calibrate", "cluster_of", "measure_worker", "predicted", "run", "shapes",
           "table"]  # fmt: skip
