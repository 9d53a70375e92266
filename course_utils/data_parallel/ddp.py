"""Data parallelism from scratch: gradients all-reduced in buckets, overlapped with backward.

The finished version of what notebook 03 builds in three steps (naive, bucketed, overlapped).
Later notebooks reuse it. Usage::

    model = BucketedDDP(net, bucket_cap_mb=25)        # every rank: same init, or an error
    loss(model(x_local), y_local).backward()           # buckets all-reduce while backward runs
    model.finish_gradient_synchronization()            # wait; grads are now the global mean
    opt.step()

What travels: once, at construction, a check (or a ``broadcast``) of parameters and a ``broadcast``
of buffers (BatchNorm's running statistics) from rank 0; unlike torch DDP's default
``broadcast_buffers=True``, buffers are not re-sent before every forward. Every step, each
bucket of gradients is summed with one ``all_reduce`` as soon as backward has produced all its
gradients, then divided by the world size. The order is reverse registration order, which is
roughly the order backward produces them. Ring all-reduce moves ``2(n-1)/n`` times the gradient
bytes per rank per step, on ``n`` ranks.

Parameters that need special care:
- **frozen** (``requires_grad=False``): never in a bucket, never communicated;
- **tied** (one ``Parameter`` used in two places): registered once, one gradient, one slot;
- **unused in forward** on a step: its gradient is absent. It counts as zero on the ranks that
  lack it, and stays ``None`` when every rank lacks it, exactly as single-process training
  leaves it. A flag per parameter travels in the bucket for that. Ranks may differ: a layer used
  on some ranks only, or gradients ready in another order, still give the mean (what torch DDP
  computes with ``find_unused_parameters=True``), because buckets start in bucket order only.

Two backward passes between synchronizations outside ``no_sync()`` raise an error. Here the first
pass's averaged gradients, written back by ``finish_gradient_synchronization``, would replace what
the second pass accumulated: its gradients would be lost without a word. torch DDP accepts the
pattern (it all-reduces after each backward and the averages add up); this reference keeps the
simpler contract, one synchronized backward per ``finish_gradient_synchronization``, and says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .comm import (
    all_reduce_async,
    broadcast_buffers,
    broadcast_parameters,
    check_same_parameters,
)


@dataclass
class GradBucket:
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    work: object | None = None
    buffer: torch.Tensor | None = None


class BucketedDDP(nn.Module):
    """Wrap ``module`` so that its gradients are averaged over ranks, overlapped with backward."""

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        init: str = "verify",
        group=None,
        first_bucket_mb: float = 1.0,
    ):
        super().__init__()
        if init not in ("verify", "broadcast"):
            raise ValueError(f"init must be 'verify' or 'broadcast', got {init!r}")
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        if init == "verify":
            check_same_parameters(module, group)
            broadcast_buffers(module, group=group)
        else:
            broadcast_parameters(module, group=group)
        # A small first bucket (as torch DDP's 1 MiB) gets the last layers' gradients travelling
        # while backward still works on the rest.
        self.buckets = self._make_buckets(
            min(first_bucket_mb, bucket_cap_mb) * 2**20, bucket_cap_mb * 2**20
        )
        self._bucket_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._names = {id(p): n for n, p in module.named_parameters()}
        self.require_sync = True
        self._next = 0  # index of the next bucket to launch
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for b in self.buckets
            for p in b.params
        ]

    def _make_buckets(self, first_cap: float, cap_bytes: float) -> list[GradBucket]:
        # tied weights appear once in parameters(); frozen ones never get a gradient
        params = [p for p in self.module.parameters() if p.requires_grad]
        buckets, current, size = [], [], 0
        for p in reversed(params):  # backward produces the last layers' gradients first
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= (first_cap if not buckets else cap_bytes):
                buckets.append(GradBucket(current))
                current, size = [], 0
        if current:
            buckets.append(GradBucket(current))
        return buckets

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_sync:
            return
        bucket, i = self._bucket_of[id(p)]
        if i in bucket.ready:
            raise RuntimeError(
                f"BucketedDDP: parameter {self._names.get(id(p), '?')!r} received a second gradient "
                "before finish_gradient_synchronization(): backward ran twice between two "
                "synchronizations. The first pass's averaged gradients would then replace what the "
                "second accumulated, and the second pass would be lost. To accumulate gradients over "
                "several backward passes, run all but the last inside `with model.no_sync():`; "
                "otherwise call finish_gradient_synchronization() (and optimizer.step()) after every "
                "backward."
            )
        bucket.ready.add(i)
        # Launch in bucket order only: gloo and NCCL pair collectives by call order, so every rank
        # must issue the same sequence even if its gradients become ready in another order.
        while self._next < len(self.buckets) and self._complete(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1

    @staticmethod
    def _complete(bucket: GradBucket) -> bool:
        return len(bucket.ready) == len(bucket.params)

    @torch.no_grad()
    def _launch(self, bucket: GradBucket) -> None:
        n = len(bucket.params)
        if (
            bucket.buffer is None
        ):  # allocated once: a fresh multi-MB buffer every step costs page faults
            first = bucket.params[0]
            bucket.buffer = first.new_empty(sum(p.numel() for p in bucket.params) + n)
        offset = 0
        for i, p in enumerate(bucket.params):
            k = p.numel()
            view = bucket.buffer[offset : offset + k]
            if p.grad is None:
                view.zero_()
            else:  # scale while copying in: sum of (g / N) over ranks is the mean
                torch.mul(p.grad.reshape(-1), 1.0 / self.world_size, out=view)
            bucket.buffer[-n + i] = float(p.grad is not None)  # the has-a-gradient flag
            offset += k
        bucket.work = all_reduce_async(bucket.buffer, self.group)  # (sum of numels + n,)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the mean gradients back; call before ``step()``."""
        if not self.require_sync:
            return
        # buckets still waiting: some parameter got no gradient this step; send what we have
        for bucket in self.buckets[self._next :]:
            self._launch(bucket)
        self._next = 0
        for bucket in self.buckets:
            bucket.work.wait()
            n = len(bucket.params)
            counts = bucket.buffer[-n:].tolist()
            offset = 0
            for p, count in zip(bucket.params, counts):
                k = p.numel()
                mean = bucket.buffer[offset : offset + k].view_as(p)
                if count == 0:
                    p.grad = None  # unused on every rank: as in single-process training
                elif p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)
                offset += k
            bucket.ready.clear()
            bucket.work = None

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) until the context exits."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


__all__ = ["GradBucket", "BucketedDDP"]
