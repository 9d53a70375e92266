"""``python -m course_utils bench ddp``: the from-scratch overlapped DDP against torch DDP.

Same model, world size, backend and bucket size. The two run as alternating launches so that
machine noise hits both alike. Reports median step time and the throughput ratio (ours / torch).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ..data_parallel import BucketedDDP
from ..launcher import launch
from . import provenance


def _model(width: int, depth: int) -> nn.Module:
    layers = [nn.Linear(512, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def step_time_worker(
    ctx,
    impl: str,
    steps: int = 20,
    warmup: int = 5,
    batch: int = 64,
    width: int = 1024,
    depth: int = 4,
    bucket_cap_mb: float = 25.0,
) -> float:
    """Median seconds per training step on this rank (run under ``launch``)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = _model(width, depth).to(ctx.device)
    if impl == "ours":
        model = BucketedDDP(net, bucket_cap_mb=bucket_cap_mb)
    else:
        ids = [ctx.device] if ctx.device.type == "cuda" else None
        model = DistributedDataParallel(net, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
    finish = getattr(model, "finish_gradient_synchronization", lambda: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 512, device=ctx.device)
    y = torch.randint(10, (batch,), device=ctx.device)
    times = []
    for i in range(warmup + steps):
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        finish()
        opt.step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(world_size: int = 2, rounds: int = 5, device: str = "auto", **worker_kwargs) -> dict:
    """Alternate launches of ours and torch's ``rounds`` times; ``device`` goes to ``launch``
    (``"auto"``: GPUs, one each or shared, else CPU ranks), ``worker_kwargs`` to the worker."""

    samples: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(rounds):
        for impl in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
            res = launch(
                step_time_worker, world_size, impl=impl, device=device, echo=False, **worker_kwargs
            )
            samples[impl].append(max(res.results))  # the slowest rank sets the pace
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "world_size": world_size,
        "rounds": rounds,
        "samples": samples,
        "median_step_s": med,
        "throughput_ratio": med["torch"] / med["ours"],
        "backend": res.backend,
        "device": res.device,
        **provenance(),
        "config": {
            "batch_per_rank": 64,
            "width": 1024,
            "depth": 4,
            "bucket_cap_mb": 25.0,
            **worker_kwargs,
        },
    }


def table(r: dict) -> str:
    med, s = r["median_step_s"], r["samples"]
    return "\n".join(
        [
            f"{r['world_size']} ranks, {r['backend']}, {r['rounds']} alternating rounds, {r['machine']}, {r['date']}",
            "| implementation | median step ms | min-max ms |",
            "| --- | ---: | ---: |",
            f"| from-scratch BucketedDDP (overlapped) | {med['ours'] * 1e3:.1f} | "
            f"{min(s['ours']) * 1e3:.1f}-{max(s['ours']) * 1e3:.1f} |",
            f"| torch DistributedDataParallel | {med['torch'] * 1e3:.1f} | "
            f"{min(s['torch']) * 1e3:.1f}-{max(s['torch']) * 1e3:.1f} |",
            f"| **throughput, ours / torch** (target >= 0.9) | **{r['throughput_ratio']:.2f}x** | |",
        ]
    )
