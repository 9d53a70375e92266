"""DDP from scratch, the first two of notebook 03's three steps: (a) naive, (b) bucketed.

Notebook 03 shows them and has the student write step (c), buckets whose all-reduces start during
backward; :class:`~.ddp.BucketedDDP` is the finished version. Both classes here keep their wrapped
model in ``self.module``, count the bytes they hand to all-reduce in ``self.bytes_reduced``, and
expose ``finish_gradient_synchronization()``, called after ``backward()`` and before
``optimizer.step()``: it leaves every ``.grad`` equal to the **mean** over ranks.

What travels: at construction, a ``broadcast`` of every parameter and buffer from rank 0 (every
rank starts from the same weights); every step, (a) one ``all_reduce`` per gradient tensor, (b) one
``all_reduce`` per bucket of about ``bucket_cap_mb``, both only after backward has finished.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class NaiveDDP(nn.Module):
    """(a) All-reduce every gradient tensor separately, after backward: one collective per tensor,
    each paying its full latency, none of them overlapping the backward pass."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)  # everyone starts from rank 0's weights
        self.bytes_reduced = 0

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self) -> None:
        n = dist.get_world_size()
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)  # one collective per tensor
                p.grad /= n
                self.bytes_reduced += p.grad.numel() * p.grad.element_size()


class BucketedNoOverlapDDP(NaiveDDP):
    """(b) Gradients packed into buckets of about ``bucket_cap_mb``, each flattened into one buffer
    and all-reduced after backward: fewer, larger messages, latency paid once per bucket.

    ``self.buckets``: lists of parameters, in reverse registration order (roughly the order backward
    produces their gradients: the last layer first), frozen parameters left out.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 1.0):
        super().__init__(module)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        current, nbytes = [], 0
        for p in reversed(params):  # backward order: last layer first
            current.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= bucket_cap_mb * 2**20:
                self.buckets.append(current)
                current, nbytes = [], 0
        if current:
            self.buckets.append(current)

    def finish_gradient_synchronization(self) -> None:
        n = dist.get_world_size()
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # (sum of numels,)
            dist.all_reduce(flat)
            self.bytes_reduced += flat.numel() * flat.element_size()
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p)).div_(n)
                offset += p.numel()


__all__ = ["NaiveDDP", "BucketedNoOverlapDDP"]
