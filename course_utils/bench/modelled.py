"""The schedule effects under modelled compute, against theory: ``python -m course_utils bench modelled``.

Three runs on real ranks over gloo, the products asleep (:mod:`course_utils.modelled`):

- the pipeline bubble of GPipe and 1F1B for p = 2 and 4 stages and m = 1, 2, 4, 8 micro-batches,
  each stage's idle share of the step against ``(p-1)/(m+p-1)``;
- torch DDP over 16 layers with 1 MB buckets on 2 ranks: the share of its all-reduce time hidden
  behind backward (from the profiler trace, notebook 04's analysis);
- the same with rank 1 computing 1.5 times slower: its extra compute against rank 0's extra wait.

``tests/test_modelled.py`` asserts the same figures (bubble within 10%, at least 80% hidden, the
wait within 15% of the extra compute), on an idle node and beside two busy loops.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn

from ..launcher import launch
from ..modelled import ModelledCompute, describe
from ..models import pipeline_mlp
from ..pipeline.parity import pipeline_worker
from ..pipeline.simulate import theory_bubble
from ..profiling import ProfileConfig
from ..profiling.analysis import analyse
from ..profiling.trace import load_traces

WIDTH, MICRO = 256, 32
PIPE_TFLOPS = 6.25e-5
"""A stage holds two blocks (Linear 256 -> 256, tanh) plus, on the first, a 16 -> 256 input layer
(cheap, so that the stages are even although the first needs no input gradient) and, on the last,
the 4-class head. A micro-batch of 32 rows costs 8.4 MFLOP forward per stage: 134 ms at this speed,
268 ms backward, against a few milliseconds of real work and gloo latency per action."""

DDP_TFLOPS = 0.025
"""Backward of 16 layers 1024 wide on 256 rows: 17 GFLOP, 688 ms asleep: long enough, on two busy
cores too, for every bucket's all-reduce but the last to finish inside it."""

CASES = tuple((s, m) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 8))


def bubbles(ctx, cases=CASES):
    """Each case's bubble on this rank: its idle share of the second step (the first warms up)."""
    out = []
    for schedule, m in cases:
        r = pipeline_worker(
            ctx, partial(pipeline_mlp, d_in=16, width=WIDTH, depth=2 * ctx.world_size + 1),
            schedule, m, steps=2, global_batch=MICRO * m, d_in=16, dtype=torch.float32,
            compare=False, compute=PIPE_TFLOPS,
        )  # fmt: skip
        t = r["timings"][-1]
        out.append(t["bubble"] / t["span"])
    return out


def ddp_steps(ctx, slow_rank=None, slowdown=1.0, steps=5, bucket_cap_mb=1.0):
    """torch DDP over 16 Linear layers (4 MiB of gradient each, a bucket each at 1 MB caps), the
    products modelled; rank ``slow_rank`` computes ``slowdown`` times slower. Returns the
    modelled compute per step (seconds)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)]).to(ctx.device)
    model = DDP(net, bucket_cap_mb=bucket_cap_mb)
    x = torch.randn(256, 1024, device=ctx.device)
    mc = ModelledCompute(tflops=DDP_TFLOPS, slowdown=slowdown if ctx.rank == slow_rank else 1.0)
    for _ in range(steps):
        with mc:
            model(x).sum().backward()
        ctx.step()
    return mc.seconds / steps


def analysis(res):
    """Notebook 04's analysis of a launch's traces."""

    return analyse(load_traces(res.traces))


def _profile():

    return ProfileConfig(wait=1, warmup=1, active=3, tensorboard=False)


def run(stages=(2, 4)) -> dict:
    """The three measurements (about 3 minutes on 2 cores)."""
    t0 = time.perf_counter()
    rows = []
    for p in stages:
        res = launch(bubbles, p, cases=CASES, echo=False, timeout=300).results
        for i, (schedule, m) in enumerate(CASES):
            measured = sum(per_rank[i] for per_rank in res) / p
            rows.append({"schedule": schedule, "p": p, "m": m, "measured": measured,
                         "theory": theory_bubble(p, m)})  # fmt: skip
    ddp = analysis(launch(ddp_steps, 2, profile=_profile(), echo=False, timeout=240)).per_rank()
    res = launch(ddp_steps, 2, slow_rank=1, slowdown=1.5, profile=_profile(), echo=False,
                 timeout=240)  # fmt: skip
    a = analysis(res)
    fast, slow = (next(r for r in a.per_rank() if r["rank"] == k) for k in (0, 1))
    straggler = {
        "named": a.straggler(),
        "modelled_extra_ms": (res.results[1] - res.results[0]) * 1e3,
        "extra_compute_ms": slow["compute"] - fast["compute"],
        "waited_ms": (fast["communication"] + fast["idle"])
        - (slow["communication"] + slow["idle"]),
    }
    return {
        "bubbles": rows,
        "pipe_tflops": PIPE_TFLOPS,
        "ddp": [
            {"rank": r["rank"], "overlap": r["overlap"], "comm_ms": r["comm_total"]} for r in ddp
        ],  # fmt: skip
        "ddp_tflops": DDP_TFLOPS,
        "straggler": straggler,
        "wall_s": time.perf_counter() - t0,
    }


def table(r: dict) -> str:
    out = [describe(r["pipe_tflops"]) + " (the pipelines)", "",
           "| schedule | p | m | measured bubble | theory (p-1)/(m+p-1) | measured / theory |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for b in r["bubbles"]:
        out.append(f"| {b['schedule']} | {b['p']} | {b['m']} | {b['measured']:.1%} | "
                   f"{b['theory']:.1%} | {b['measured'] / b['theory']:.2f} |")  # fmt: skip
    out += ["", describe(r["ddp_tflops"]) + " (DDP, 2 ranks, 16 buckets of 4 MiB)"]
    for d in r["ddp"]:
        out.append(f"rank {d['rank']}: all-reduce {d['comm_ms']:.0f} ms per step, "
                   f"{d['overlap']:.0%} of it hidden behind backward")  # fmt: skip
    s = r["straggler"]
    out.append(f"rank 1 at 1.5x the compute: straggler named {s['named']}; modelled extra "
               f"{s['modelled_extra_ms']:.0f} ms, traced extra compute {s['extra_compute_ms']:.0f} "
               f"ms, rank 0's extra wait {s['waited_ms']:.0f} ms")  # fmt: skip
    out.append(f"({r['wall_s']:.0f} s)")
    return "\n".join(out)
