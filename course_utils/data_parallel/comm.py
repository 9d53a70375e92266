"""What data parallelism sends between ranks: parameters once, gradients every step.

- :func:`check_same_parameters`: every rank starts from the same weights, or a clear error.
- :func:`broadcast_parameters`: copy rank 0's parameters and buffers to every rank (``broadcast``).
- :func:`all_reduce_async`: start the sum of a bucket over ranks (``all_reduce``, ring:
  each rank sends and receives ``2(N-1)/N`` of the buffer), returning a handle to wait on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_parameters(module: nn.Module, src: int = 0, group=None) -> None:
    """Overwrite every rank's parameters and buffers with rank ``src``'s."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def check_same_parameters(module: nn.Module, group=None) -> None:
    """Raise if any rank's parameters differ from rank 0's in count, shape or value (exactly)."""
    named = list(module.named_parameters())
    shapes = [tuple(p.shape) for _, p in named]
    all_shapes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(all_shapes, shapes, group=group)
    for rank, other in enumerate(all_shapes):
        if other != shapes:
            raise ValueError(
                f"rank {rank} has a different model than rank {dist.get_rank(group)}: parameter shapes "
                f"{other} vs {shapes}. Every rank must build the same architecture."
            )
    with torch.no_grad():
        mine = (
            torch.stack([p.detach().double().sum() for _, p in named]) if named else torch.zeros(1)
        )
        mine = (
            torch.cat([mine, torch.stack([p.detach().double().abs().sum() for _, p in named])])
            if named
            else mine
        )
        ref = mine.clone()
        dist.broadcast(ref, src=0, group=group)
        bad = torch.tensor([float(not torch.equal(mine, ref))], device=mine.device)
        flags = [torch.zeros_like(bad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(flags, bad, group=group)
    differing = [r for r, f in enumerate(flags) if f.item()]
    if differing:
        first = next((n for (n, _), a, b in zip(named, mine, ref) if a != b), named[0][0])
        raise ValueError(
            f"ranks {differing} start with parameters that differ from rank 0's (first: {first!r}). "
            "Seed every rank the same way before building the model (torch.manual_seed(0)), or "
            "pass init='broadcast' to copy rank 0's parameters to every rank."
        )


def all_reduce_async(buffer: torch.Tensor, group=None):
    """Start summing ``buffer`` over all ranks; ``.wait()`` on the result before reading it."""
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
