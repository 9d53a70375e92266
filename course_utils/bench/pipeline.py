"""``python -m course_utils bench pipeline``: the bubble against theory, throughput against m,
and the from-scratch 1F1B against ``torch.distributed.pipelining.Schedule1F1B``.

All on ``p`` ranks with one fixed global batch split into ``m`` micro-batches. The measured bubble
comes from the profiler traces (:mod:`course_utils.pipeline.measure`). The two 1F1B
implementations run as alternating launches so that machine noise hits both alike.
"""

from __future__ import annotations

import statistics

import torch

from ..models import pipeline_mlp
from ..pipeline.measure import measured_bubble
from ..pipeline.run import run_pipeline
from ..pipeline.simulate import theory_bubble
from ..profiling import ProfileConfig
from ..profiling.trace import load_traces
from . import provenance

D_IN, WIDTH, DEPTH = 256, 512, 8


def _model():
    return pipeline_mlp(d_in=D_IN, width=WIDTH, depth=DEPTH)


def _step_ms(res) -> float:
    """Median step of the slowest rank, warm-up steps left out."""
    return max(statistics.median(r["step_s"][2:]) for r in res.results) * 1e3


def run(
    p: int = 2, global_batch: int = 1024, ms=(1, 2, 4, 8, 16), rounds: int = 5, steps: int = 6
) -> dict:
    common = dict(global_batch=global_batch, d_in=D_IN, dtype=torch.float32, compare=False)
    bubble, throughput = [], []
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            res = run_pipeline(
                _model,
                schedule,
                p=p,
                m=m,
                steps=4,
                **common,
                launch_kwargs={
                    "profile": ProfileConfig(wait=1, warmup=1, active=2, tensorboard=False)
                },
            )
            b = measured_bubble(load_traces(res.traces))
            bubble.append(
                {"schedule": schedule, "m": m, "measured": b["mean"], "theory": theory_bubble(p, m)}
            )
    for m in ms:
        res = run_pipeline(_model, "1f1b", p=p, m=m, steps=steps, **common)
        step = _step_ms(res)
        throughput.append({"m": m, "step_ms": step, "samples_per_s": global_batch / step * 1e3})
    m_cmp = max(x for x in ms if x % p == 0)
    samples = {"from-scratch 1f1b": [], "torch Schedule1F1B": []}
    for i in range(rounds):
        for name in list(samples) if i % 2 == 0 else list(samples)[::-1]:
            schedule = "1f1b" if name.startswith("from") else "torch_1f1b"
            samples[name].append(
                _step_ms(run_pipeline(_model, schedule, p=p, m=m_cmp, steps=steps, **common))
            )
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "p": p,
        "global_batch": global_batch,
        "bubble": bubble,
        "throughput": throughput,
        "compare_m": m_cmp,
        "samples_ms": samples,
        "median_ms": med,
        "ratio": med["torch Schedule1F1B"] / med["from-scratch 1f1b"],
        **provenance(),
        "model": f"pipeline_mlp(d_in={D_IN}, width={WIDTH}, depth={DEPTH}), float32",
    }


def table(r: dict) -> str:
    lines = [
        f"p={r['p']} stages, global batch {r['global_batch']}, {r['model']}, {r['machine']}, {r['date']}",
        "",
        "| schedule | m | measured bubble | theory (p-1)/(m+p-1) |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {b['schedule']} | {b['m']} | {b['measured']:.1%} | {b['theory']:.1%} |"
        for b in r["bubble"]
    ]
    lines += ["", "| 1f1b, m | step ms | samples/s |", "| ---: | ---: | ---: |"]
    lines += [
        f"| {t['m']} | {t['step_ms']:.1f} | {t['samples_per_s']:.0f} |" for t in r["throughput"]
    ]
    s = r["samples_ms"]
    lines += [
        "",
        f"1F1B at m={r['compare_m']}, alternating launches:",
        "| implementation | median step ms | min-max |",
        "| --- | ---: | ---: |",
    ]
    lines += [
        f"| {k} | {r['median_ms'][k]:.1f} | {min(v):.1f}-{max(v):.1f} |" for k, v in s.items()
    ]
    lines.append(f"| **speed, from-scratch / torch** | **{r['ratio']:.2f}x** | |")
    return "\n".join(lines)
