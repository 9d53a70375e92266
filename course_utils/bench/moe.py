"""``python -m course_utils bench moe``: expert parallelism against one process and against
replicated experts.

One MoE layer (:class:`~course_utils.expert_parallel.MoE`, float32, top-2, dropless), a training
step (forward, backward, SGD) on ``n`` ranks each with its own tokens, three ways:

- ``ep``: the experts spread over the ``n`` ranks (:func:`~course_utils.expert_parallel.apply_ep`),
  tokens dispatched and combined by all-to-alls;
- ``replicated``: every rank holds every expert (plain data parallelism): no all-to-all, but every
  parameter's gradient all-reduced;
- ``single``: one process on one rank's tokens (``n = 1``).

Per way and ``n``: the median step time of the slowest rank (launches alternate, the order reversed
every round), the values each rank sends (counted at ``torch.distributed``), and the rows each
rank's experts ran on (the load).

    python -m course_utils bench moe --world-sizes 2 4 --rounds 3
"""

from __future__ import annotations

import statistics

import torch

from ..comm import AllToAllCounter, CollectiveCounter, ring_bytes
from ..expert_parallel import MoE, MoEConfig, apply_ep
from ..measure import time_steps
from . import alternating, provenance

DEFAULTS = {"d_model": 256, "n_experts": 8, "top_k": 2, "ffn_mult": 4, "tokens": 1024,
            "steps": 5, "warmup": 2}  # fmt: skip
WAYS = ("ep", "replicated")
LR = 0.01


def step_worker(ctx, way: str, d_model, n_experts, top_k, ffn_mult, tokens, steps, warmup) -> dict:
    """Median seconds per training step of the layer on this rank, values sent, rows per expert."""
    import torch.distributed as dist

    n = ctx.world_size
    cfg = MoEConfig(d_model=d_model, n_experts=n_experts, top_k=top_k, ffn_mult=ffn_mult)
    torch.manual_seed(0)
    moe = MoE(cfg).to(ctx.device)
    if way == "ep":
        apply_ep(moe, None)
    params = list(moe.parameters())
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(tokens, d_model, generator=g).to(ctx.device)

    def step():
        moe(x).square().mean().backward()
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if way == "replicated" and n > 1:
                    dist.all_reduce(p.grad)  # every parameter on every rank
                p.add_(p.grad, alpha=-LR)
                p.grad = None

    with CollectiveCounter() as c, AllToAllCounter(ctx.rank, n) as a2a:
        step()
    others = sum(ring_bytes(kind, nb, n) for kind, nb in c.calls if kind != "all_to_all") / 4
    sent = others + a2a.values  # float32 values, all-reduces as a ring sends them
    rows = moe.stats.get("expert_rows") if way == "ep" else moe.routing.counts.tolist()
    return {"step_s": statistics.median(time_steps(step, steps, warmup, ctx.device)),
            "sent": sent, "rows": rows}  # fmt: skip


def run(world_sizes=(2, 4), rounds: int = 3, device: str = "auto", **sizes) -> dict:
    """Both ways at every ``n``, ``rounds`` times, alternating; plus one process."""

    cfg = {**DEFAULTS, **sizes}
    bad = [n for n in world_sizes if cfg["n_experts"] % n]
    if bad:
        raise ValueError(
            f"world sizes {bad} do not split n_experts={cfg['n_experts']} evenly: pick degrees "
            f"that divide {cfg['n_experts']}"
        )
    runs = [("single", 1)] + [(w, n) for n in world_sizes for w in WAYS]
    samples, extra, backend = alternating(step_worker, runs, rounds, name_kw="way",
                                          device=device, **cfg)  # fmt: skip
    rows = []
    for way, n in runs:
        rows.append({
            "way": way, "n": n, "median_ms": statistics.median(samples[way, n]),
            "samples_ms": samples[way, n], "sent_values": max(r["sent"] for r in extra[way, n]),
            "rows_per_rank": [sum(r["rows"]) for r in extra[way, n]],
        })  # fmt: skip
    return {"rounds": rounds, "backend": backend, "rows": rows, "config": cfg, **provenance()}


def table(r: dict) -> str:
    c = r["config"]
    out = [
        f"one MoE layer, h={c['d_model']}, {c['n_experts']} experts, top-{c['top_k']}, "
        f"expert width {c['ffn_mult']}h, {c['tokens']} tokens per rank, float32, forward + backward "
        f"+ SGD; {r['backend']}, {r['rounds']} alternating rounds of {c['warmup']} warm-up + "
        f"{c['steps']} timed steps; {r['machine']}, {r['date']}",
        "",
        "| way | ranks | step ms, slowest rank (min-max) | values sent per rank | rows the experts "
        "ran on, per rank |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for row in r["rows"]:
        s = row["samples_ms"]
        out.append(
            f"| {row['way']} | {row['n']} | {row['median_ms']:.1f} ({min(s):.1f}-{max(s):.1f}) | "
            f"{row['sent_values']:,.0f} | {row['rows_per_rank']} |"
        )
    return "\n".join(out)
