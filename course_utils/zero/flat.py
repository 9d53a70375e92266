"""Flat, padded buffers: the layout every ZeRO stage shares.

A bucket lays a list of parameters end to end in one flat buffer and pads it to a multiple of the
world size ``n``, so that the buffer splits into ``n`` equal shards and rank ``r`` owns elements
``[r·S, (r+1)·S)``, ``S = padded / n``. Reduce-scatter and all-gather then move equal pieces, as
NCCL and gloo require, and every rank holds exactly ``1/n`` of the bucket.

A parameter may straddle two shards. That is the difference from torch's
``ZeroRedundancyOptimizer``, which hands out *whole* parameters to ranks (greedily, largest first)
and so leaves the ranks uneven: a model with one big embedding puts most of the optimizer state
on one rank.

    layout = Bucket.of(params, n=4)      # 10 + 6 elements, padded to 16: shards of 4
    layout.padded, layout.shard_numel    # (16, 4)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def padded_numel(numel: int, n: int) -> int:
    """``numel`` rounded up to a multiple of ``n`` (what a flat buffer of ``numel`` holds)."""
    return -(-numel // n) * n


@dataclass
class Bucket:
    """Parameters laid end to end: ``offsets[i]`` is where ``params[i]`` starts in the flat buffer."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # the parameters' elements, without padding
    n: int  # world size

    @classmethod
    def of(cls, params, n: int) -> Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        return cls(list(params), offsets, total, n)

    @property
    def padded(self) -> int:
        return padded_numel(self.numel, self.n)

    @property
    def shard_numel(self) -> int:
        return self.padded // self.n

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of ``flat``, shaped like the parameter (views, no copy)."""
        return [flat[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def flatten(self, tensors, dtype=None, device=None) -> torch.Tensor:
        """``tensors`` (one per parameter; ``None`` counts as zeros) in one padded flat buffer."""
        first = self.params[0]
        flat = torch.zeros(self.padded, dtype=dtype or first.dtype, device=device or first.device)
        for t, o in zip(tensors, self.offsets):
            if t is not None:
                flat[o : o + t.numel()].copy_(t.reshape(-1))
        return flat


def split_buckets(params, n: int, cap_numel: int | None) -> list[Bucket]:
    """``params`` in buckets of at most ``cap_numel`` elements (a bigger parameter gets its own),
    in the order given; ``None``: one bucket."""
    params = list(params)
    if cap_numel is None or not params:
        return [Bucket.of(params, n)] if params else []
    out, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > cap_numel:
            out.append(Bucket.of(current, n))
            current, size = [], 0
        current.append(p)
        size += p.numel()
    out.append(Bucket.of(current, n))
    return out


def unique_trainable(params) -> list[nn.Parameter]:
    """Parameters in first-seen order, each once (tied weights), frozen ones left out."""
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
