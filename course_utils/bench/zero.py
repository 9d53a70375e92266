"""``python -m course_utils bench zero``: every way to shard data parallelism, side by side.

One GPT (:class:`~course_utils.models.GPT`, float32, Adam) trained on ``n`` ranks with each of
:data:`~course_utils.zero.run.METHODS`: torch DDP, ZeRO-1 (and its naive all-reduce form), ZeRO-2
and ZeRO-3 from this package, DDP with ``ZeroRedundancyOptimizer``, and FSDP2 ``fully_shard``.
ZeRO-3 and FSDP2 use the same units: each transformer block, and the rest at the root.

Per method and world size: the median step time of the slowest rank (alternating launches, the
order reversed every round, so that machine noise hits all alike), the model-state bytes each
rank holds after the step (:func:`~course_utils.zero.count_model_states`; the largest rank), the
paper's formula for it, and the bytes sent per step as a multiple of the parameters' bytes.

    python -m course_utils bench zero --world-sizes 2 4 --rounds 3
"""

from __future__ import annotations

import statistics

import torch
from torch.nn import functional as F

from ..compat import fsdp2_unsupported
from ..launcher import launch, placement
from ..measure import allocated_memory, time_steps
from ..models import GPT, GPTConfig
from ..zero import count_model_states, model_state_bytes, traffic
from ..zero.run import wrap
from . import provenance

DEFAULTS = {"vocab": 512, "seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 4,
            "batch_per_rank": 4, "steps": 6, "warmup": 2}  # fmt: skip
METHODS = ("ddp", "zero1", "zero1-naive", "zero2", "zero3", "zero-redundancy", "fsdp2")
STAGE = {"ddp": 0, "zero1": 1, "zero1-naive": 1, "zero2": 2, "zero3": 3, "zero-redundancy": 1,
         "fsdp2": 3}  # fmt: skip


def _config(c: dict) -> GPTConfig:
    return GPTConfig(vocab=c["vocab"], seq_len=c["seq_len"], d_model=c["d_model"],
                     n_heads=c["n_heads"], n_layers=c["n_layers"])  # fmt: skip


def step_worker(ctx, method: str, **c) -> dict:
    """Median seconds per Adam step of the GPT with ``method``, model states, bytes sent."""
    torch.manual_seed(0)
    model = GPT(_config(c)).to(ctx.device)
    units = list(model.blocks) if method in ("zero3", "fsdp2") else None
    call, opt, _ = wrap(method, model, "adam", ctx.device, units=units)
    gen = torch.Generator().manual_seed(ctx.rank)  # each rank its own data
    x = torch.randint(c["vocab"], (c["batch_per_rank"], c["seq_len"]), generator=gen).to(ctx.device)
    y = torch.randint(c["vocab"], (c["batch_per_rank"], c["seq_len"]), generator=gen).to(ctx.device)
    states = {}

    def step():
        loss = F.cross_entropy(call(x).flatten(0, 1), y.flatten())
        loss.backward()
        getattr(call, "finish_gradient_synchronization", lambda: None)()
        opt.step()
        states["now"] = count_model_states(call, opt).total
        opt.zero_grad()

    times = time_steps(step, c["steps"], c["warmup"], ctx.device)
    with traffic.recording() as log:
        step()
    return {
        "s": statistics.median(times),
        "states": states["now"],
        "volume": log.volume_bytes,
        # on a GPU, what the CUDA allocator holds after the step (the batch, workspaces and any
        # buffers the method keeps included; None on the CPU)
        "allocated": allocated_memory(ctx.device),
    }


def run(
    world_sizes=(2, 4), rounds: int = 3, device: str = "auto", methods=METHODS, **sizes
) -> dict:

    c = {**DEFAULTS, **sizes}
    psi = sum(p.numel() for p in GPT(_config(c)).parameters())
    rows, backend, skipped = [], None, {}
    for n in world_sizes:
        device_type = placement.place_ranks(
            n, device=device
        ).device_type  # where launch will put them
        if "fsdp2" in methods and fsdp2_unsupported(device_type):
            skipped["fsdp2"] = fsdp2_unsupported(device_type)
        methods_n = tuple(m for m in methods if m not in skipped)
        samples = {m: [] for m in methods_n}
        last = {}
        for i in range(rounds):
            for m in methods_n if i % 2 == 0 else methods_n[::-1]:
                res = launch(
                    step_worker, n, method=m, device=device, echo=False, progress=False, **c
                )
                samples[m].append(max(r["s"] for r in res.results) * 1e3)
                last[m] = res.results
                backend = res.backend
        for m in methods_n:
            rows.append({
                "n": n, "method": m, "median_ms": statistics.median(samples[m]), "samples_ms": samples[m],
                "states_bytes": max(r["states"] for r in last[m]),
                "formula_bytes": model_state_bytes(psi, n, STAGE[m], k=8, param_bytes=4, grad_bytes=4),
                "volume_per_psi": max(r["volume"] for r in last[m]) / (4 * psi),
                "allocated_bytes": None if last[m][0]["allocated"] is None
                else max(r["allocated"] for r in last[m]),
            })  # fmt: skip
    return {"world_sizes": list(world_sizes), "rounds": rounds, "backend": backend, "psi": psi,
            "rows": rows, "skipped": skipped, "config": {**c, "dtype": "float32", "optimizer": "Adam"},
            **provenance()}  # fmt: skip


def ratio(r: dict, n: int, a: str = "fsdp2", b: str = "zero3") -> float | None:
    """Throughput of ``b`` over ``a`` at ``n`` ranks (step time of ``a`` / step time of ``b``)."""
    rows = {row["method"]: row for row in r["rows"] if row["n"] == n}
    if a in rows and b in rows:
        return rows[a]["median_ms"] / rows[b]["median_ms"]
    return None


def table(r: dict) -> str:
    c, mib = r["config"], 2**20
    gpu = any(row.get("allocated_bytes") is not None for row in r["rows"])
    out = [
        f"GPT (h={c['d_model']}, L={c['n_layers']}, v={c['vocab']}, s={c['seq_len']}, "
        f"Ψ={r['psi']:,}, float32 Adam), {c['batch_per_rank']} sequences per rank, {r['backend']}, "
        f"{r['rounds']} alternating rounds of {c['warmup']} warm-up + {c['steps']} timed steps, "
        f"{r['machine']}, {r['date']}",
        "",
        "| n | method | step ms (median, range) | model states / rank MiB | formula MiB | "
        "measured / formula | sent per step (×Ψ bytes) |"
        + (" CUDA allocator / rank MiB |" if gpu else ""),
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if gpu else ""),
    ]
    for row in r["rows"]:
        s = row["samples_ms"]
        vol = f"{row['volume_per_psi']:.2f}" if row["volume_per_psi"] else "(torch's own)"
        held = row.get("allocated_bytes")
        out.append(
            f"| {row['n']} | {row['method']} | {row['median_ms']:.1f} ({min(s):.1f}-{max(s):.1f}) | "
            f"{row['states_bytes'] / mib:.2f} | {row['formula_bytes'] / mib:.2f} | "
            f"{row['states_bytes'] / row['formula_bytes']:.3f} | {vol} |"
            + (f" {held / mib:.2f} |" if gpu else "")
        )
    for n in r["world_sizes"]:
        q = ratio(r, n)
        if q is not None:
            out.append(
                f"\nn={n}: throughput from-scratch ZeRO-3 / FSDP2 = **{q:.2f}×** (target ≥ 0.9)"
            )
    for m, why in r.get("skipped", {}).items():
        out.append(f"\n{m} not run: {why}")
    return "\n".join(out)
