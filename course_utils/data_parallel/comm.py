"""What data parallelism sends between ranks: parameters once, gradients every step.

- :func:`check_same_parameters`: every rank starts from the same weights, bit for bit, or a clear
  error (a SHA-256 digest per parameter travels, ``all_gather_object``).
- :func:`broadcast_parameters`: copy rank 0's parameters and buffers to every rank (``broadcast``).
- :func:`broadcast_buffers`: copy rank 0's buffers only.
- :func:`all_reduce_async`: start the sum of a bucket over ranks (``all_reduce``, ring:
  each of n ranks sends and receives ``2(n-1)/n`` of the buffer), returning a handle to wait on.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn


def broadcast_parameters(module: nn.Module, src: int = 0, group=None) -> None:
    """Overwrite every rank's parameters and buffers with rank ``src``'s."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def broadcast_buffers(module: nn.Module, src: int = 0, group=None) -> None:
    """Overwrite every rank's buffers (BatchNorm's running statistics, ...) with rank ``src``'s."""
    with torch.no_grad():
        for t in module.buffers():
            dist.broadcast(t.data, src=src, group=group)


def _digest(t: torch.Tensor) -> bytes:
    """SHA-256 of a tensor's bytes: equal digests mean equal bits (``-0.0`` and ``0.0`` differ)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).digest()


def check_same_parameters(module: nn.Module, group=None) -> None:
    """Raise unless every rank's parameters equal rank 0's, bit for bit, in name, shape and value.

    Each rank hashes its parameters (SHA-256 of their bytes); only the 32-byte digests travel,
    in one ``all_gather_object``. Permuted or sign-flipped weights, which a sum would miss, differ.
    """
    named = list(module.named_parameters())
    mine = [(name, tuple(p.shape), str(p.dtype), _digest(p)) for name, p in named]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    me = dist.get_rank(group)
    ref = everyone[0]
    for rank, other in enumerate(everyone):
        if [row[:3] for row in other] != [row[:3] for row in ref]:
            raise ValueError(
                f"rank {rank} has a different model than rank 0: parameters "
                f"{[row[:3] for row in other]} vs {[row[:3] for row in ref]}. Every rank must build "
                "the same architecture."
            )
    differing = [r for r, other in enumerate(everyone) if other != ref]
    if differing:
        first = next(a[0] for a, b in zip(everyone[differing[0]], ref) if a != b)
        raise ValueError(
            f"ranks {differing} start with parameters that differ from rank 0's (first: {first!r}; "
            f"this is rank {me}). Seed every rank the same way before building the model "
            "(torch.manual_seed(0)), or pass init='broadcast' to copy rank 0's parameters to "
            "every rank."
        )


def all_reduce_async(buffer: torch.Tensor, group=None):
    """Start summing ``buffer`` over all ranks; ``.wait()`` on the result before reading it."""
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
