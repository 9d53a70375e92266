"""``python -m course_utils bench cp``: ring attention (contiguous and zig-zag) and Ulysses, side by
side, against attention on one process.

One causal attention layer's core (Q, K, V given: (B, H, S, D), float32), forward and backward, on
``P`` ranks each holding ``S/P`` tokens, with each method of :mod:`course_utils.context_parallel`:

- ``ring``: ring attention on the contiguous layout (the causal mask's load uneven);
- ``ring-zigzag``: ring attention on the zig-zag layout (the load even);
- ``ulysses``: two all-to-alls around whole-sequence attention on ``H/P`` heads;
- ``single``: the same attention on one process (``P = 1``), the whole sequence.

Per method and ``P``: the median step time of the slowest rank (launches alternate, the order
reversed every round, so that machine noise hits all alike), and the values each rank sends,
counted at ``torch.distributed`` against :func:`~course_utils.context_parallel.values_per_rank`.
On CPU ranks sharing a few cores the times show the methods' overheads, not the speed-up that
one GPU per rank gives.

    python -m course_utils bench cp --world-sizes 2 4 --rounds 3
"""

from __future__ import annotations

import statistics

import torch

from ..comm import CollectiveCounter, ring_bytes
from ..context_parallel import (
    attention,
    positions,
    ring_attention,
    ulysses_attention,
    values_per_rank,
)
from ..measure import time_steps
from . import alternating, provenance

DEFAULTS = {"batch": 1, "heads": 8, "seq_len": 2048, "head_dim": 64, "steps": 5, "warmup": 2}
METHODS = ("ring", "ring-zigzag", "ulysses")


def step_worker(ctx, method: str, batch, heads, seq_len, head_dim, steps, warmup) -> dict:
    """Median seconds of one forward + backward of the attention core on this rank, and the values
    it sent in one (run under ``launch``)."""

    n = ctx.world_size
    torch.manual_seed(ctx.rank)
    local = seq_len // n
    q, k, v = (
        torch.randn(batch, heads, local, head_dim, device=ctx.device, requires_grad=True)
        for _ in range(3)
    )
    if method == "single":
        fn = lambda: attention(q, k, v, True)  # noqa: E731
    else:
        layout = "zigzag" if method in ("ring-zigzag", "ulysses") else "contiguous"
        pos = positions(layout, n, seq_len)
        impl = ulysses_attention if method == "ulysses" else ring_attention
        fn = lambda: impl(q, k, v, pos, None, True)  # noqa: E731

    def step():
        fn().sum().backward()

    with CollectiveCounter(p2p=True) as c:
        step()
    sent = sum(ring_bytes(kind, nb, n) for kind, nb in c.calls) / 4  # float32 values
    return {"step_s": statistics.median(time_steps(step, steps, warmup, ctx.device)), "sent": sent}


def run(world_sizes=(2, 4), rounds: int = 3, device: str = "auto", **sizes) -> dict:
    """Every method at every ``P``, ``rounds`` times, alternating; plus one process."""

    cfg = {**DEFAULTS, **sizes}
    bad = [p for p in world_sizes if cfg["heads"] % p or cfg["seq_len"] % (2 * p)]
    if bad:
        raise ValueError(
            f"world sizes {bad} must divide heads={cfg['heads']} (Ulysses) and half of "
            f"seq_len={cfg['seq_len']} (zig-zag): pick degrees that do"
        )
    runs = [("single", 1)] + [(m, p) for p in world_sizes for m in METHODS]
    samples, results, backend = alternating(step_worker, runs, rounds, name_kw="method",
                                            device=device, **cfg)  # fmt: skip
    sent = {key: max(r["sent"] for r in res) for key, res in results.items()}
    rows = []
    for method, p in runs:
        base = "ring" if method.startswith("ring") else method
        formula = (
            values_per_rank(base, cfg["batch"], cfg["seq_len"], cfg["heads"] * cfg["head_dim"], p)
            if method != "single"
            else {"forward": 0.0, "backward": 0.0}
        )
        rows.append({
            "method": method, "P": p, "median_ms": statistics.median(samples[method, p]),
            "samples_ms": samples[method, p], "sent_values": sent[method, p],
            "formula_values": formula["forward"] + formula["backward"],
        })  # fmt: skip
    return {"rounds": rounds, "backend": backend, "rows": rows, "config": cfg, **provenance()}


def table(r: dict) -> str:
    c = r["config"]
    single = next(row["median_ms"] for row in r["rows"] if row["method"] == "single")
    out = [
        f"causal attention core, B={c['batch']}, H={c['heads']}, S={c['seq_len']}, "
        f"D={c['head_dim']}, float32, forward + backward; {r['backend']}, {r['rounds']} "
        f"alternating rounds of {c['warmup']} warm-up + {c['steps']} timed steps; {r['machine']}, "
        f"{r['date']}",
        "",
        "| method | P | step ms, slowest rank (min-max) | / one process | values sent per rank "
        "| formula |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        s = row["samples_ms"]
        out.append(
            f"| {row['method']} | {row['P']} | {row['median_ms']:.1f} ({min(s):.1f}-{max(s):.1f}) | "
            f"{row['median_ms'] / single:.2f} | {row['sent_values']:,.0f} | "
            f"{row['formula_values']:,.0f} |"
        )
    return "\n".join(out)
