"""Tiny importable workers, used by the docs, the benchmark and the tests.

python -c "from course_utils import launch; print(launch('course_utils.launcher.demo:hello', 2).results)"
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def hello(ctx) -> dict:
    """Each rank contributes ``rank + 1``; everyone gets the sum ``n(n+1)/2``."""
    t = torch.tensor([ctx.rank + 1.0], device=ctx.device)
    dist.all_reduce(t)
    print(f"hello from rank {ctx.rank} of {ctx.world_size} on {ctx.device}")
    return {"rank": ctx.rank, "sum": t.item(), "device": str(ctx.device)}


def all_reduce_once(ctx, numel: int = 1024) -> float:
    """One all_reduce of ``numel`` floats; the trivial job the launch benchmark times."""
    t = torch.ones(numel, device=ctx.device)
    dist.all_reduce(t)
    return t[0].item()
