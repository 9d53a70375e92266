"""The collective benchmark: time, algorithm bandwidth and bus bandwidth per message size.

    python -m course_utils bench collectives --world-size 2

Definitions follow nccl-tests (``doc/PERFORMANCE.md``): ``size`` is the bytes of
the whole buffer (all_gather: the gathered output; reduce_scatter: the input),
``algbw = size / time``, and ``busbw = algbw * factor``, the factor being what
each rank must send or receive at least, so busbw is comparable with the
link's peak bandwidth whatever the number of ranks:

============== ==============
all_reduce     2 (n - 1) / n
all_gather     (n - 1) / n
reduce_scatter (n - 1) / n
broadcast      1
all_to_all     (n - 1) / n
============== ==============

(:func:`course_utils.comm.ring_factor`, the one place these are written).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..comm.ledger import OPS, ring_factor
from ..launcher import launch
from ..sizes import get_size


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``op`` on ``n`` ranks: the ledger's ring factor."""
    return ring_factor(op, n)


def message_sizes(max_bytes: int, min_bytes: int = 1024, factor: int = 4) -> list[int]:
    """1 KiB, 4 KiB, 16 KiB, ... up to ``max_bytes``."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def _make_call(op: str, numel: int, n: int, device: torch.device):
    """Buffers for one collective of ``numel`` float32 elements in total, and the call."""
    if op == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.ones(numel, device=device)
        return lambda: dist.broadcast(t, src=0)
    if op == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        out, inp = torch.empty(numel // n, device=device), torch.ones(numel, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if op == "all_to_all":
        out, inp = torch.empty(numel, device=device), torch.ones(numel, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    raise ValueError(f"unknown collective {op!r}: choose from {OPS}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_worker(ctx, ops=OPS, sizes=(1024, 1 << 20), iters: int = 10, warmup: int = 2) -> dict:
    """Run on every rank (via ``launch``): time each collective; the slowest rank's time counts."""
    n = ctx.world_size
    rows, unsupported = [], {}
    for op in ops:
        for nbytes in sizes:
            numel = max(n, nbytes // 4 // n * n)  # float32, divisible by the number of ranks
            call = _make_call(op, numel, n, ctx.device)
            try:
                call()
            except (RuntimeError, NotImplementedError, ValueError) as e:
                unsupported[op] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                break
            for _ in range(warmup):
                call()
            _sync(ctx.device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            _sync(ctx.device)
            t = torch.tensor(
                [(time.perf_counter() - t0) / iters], dtype=torch.float64, device=ctx.device
            )
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = t.item()
            size = numel * 4
            algbw = size / seconds / 1e9
            rows.append(
                {
                    "op": op,
                    "bytes": size,
                    "time_us": seconds * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * bus_factor(op, n),
                }
            )
    return {"rows": rows, "unsupported": unsupported, "world_size": n, "backend": ctx.backend}


def run(
    world_size: int = 2, max_bytes: int | None = None, ops=OPS, iters: int = 10, **launch_kwargs
) -> dict:
    """Benchmark ``ops`` on ``world_size`` ranks of the backend ``launch`` picks; rank 0's report."""

    sizes = message_sizes(max_bytes or get_size().max_message_bytes)
    res = launch(
        bench_worker, world_size, ops=tuple(ops), sizes=tuple(sizes), iters=iters, **launch_kwargs
    )
    return res.results[0]


def table(report: dict) -> str:
    lines = [
        f"{report['world_size']} ranks, {report['backend']}; busbw = algbw x nccl-tests factor",
        f"{'op':<15}{'size':>10}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['op']:<15}{_fmt_size(r['bytes']):>10}{r['time_us']:11.1f}{r['algbw_GBps']:12.3f}"
            f"{r['busbw_GBps']:12.3f}"
        )
    for op, why in report["unsupported"].items():
        lines.append(f"{op:<15} not supported by {report['backend']}: {why}")
    return "\n".join(lines)


def _fmt_size(b: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024:
            return f"{b:.0f} {unit}"
        b /= 1024
    return f"{b:.0f} TiB"


def plot(report: dict, ax=None):
    """Bus bandwidth against message size, one line per collective."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    for op in dict.fromkeys(r["op"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["op"] == op]
        ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{report['backend']}, {report['world_size']} ranks")
    ax.legend(frameon=False)
    return ax
