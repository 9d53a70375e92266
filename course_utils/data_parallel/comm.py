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
    with torch.no_grad():  # per parameter: (sum, sum of |x|) in float64, a cheap exact fingerprint
        device = named[0][1].device if named else torch.device("cpu")
        mine = torch.tensor(
            [[p.double().sum().item(), p.double().abs().sum().item()] for _, p in named],
            dtype=torch.float64,
            device=device,
        ).reshape(-1, 2)  # (n_params, 2)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
    ref = everyone[0]
    differing = [r for r, fp in enumerate(everyone) if not torch.equal(fp, ref)]
    if differing:
        rows = (everyone[differing[0]] != ref).any(dim=1).nonzero()
        first = named[int(rows[0])][0]
        raise ValueError(
            f"ranks {differing} start with parameters that differ from rank 0's (first: {first!r}). "
            "Seed every rank the same way before building the model (torch.manual_seed(0)), or "
            "pass init='broadcast' to copy rank 0's parameters to every rank."
        )


def all_reduce_async(buffer: torch.Tensor, group=None):
    """Start summing ``buffer`` over all ranks; ``.wait()`` on the result before reading it."""
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
