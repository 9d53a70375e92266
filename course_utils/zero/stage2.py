"""ZeRO stage 2 (P_os+g): gradients sharded too, reduce-scattered in buckets during backward.

Stage 1 keeps every rank's full gradient until the step. Stage 2 reduce-scatters a bucket of
gradients as soon as backward has produced all of them, while backward goes on computing the
earlier layers, and frees them: a rank then holds only its shard of the gradients (``Ψ/n``) plus
the buckets in flight. Communication stays ``2Ψ``: the same reduce-scatter, then the same
all-gather of the parameters after the step.

- buckets are filled in reverse parameter order (the order backward produces gradients) and
  launched strictly in bucket order, so that every rank calls the same collectives in the same
  order even when its gradients arrive in another;
- a parameter's gradient is copied into its bucket by a post-accumulate-grad hook
  (``Tensor.register_post_accumulate_grad_hook``), then ``param.grad`` is set to ``None``;
- a bucket still incomplete when ``step()`` runs (a parameter unused this step) is sent then,
  its missing gradients counting as zero; several backward passes before a step add up.

Every rank must use the same parameters in a step (FSDP has the same rule): a bucket complete on
one rank and incomplete on another would be launched in different orders.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import traffic
from .flat import Bucket
from .stage1 import ShardedOptimizer


class ShardedGradientOptimizer(ShardedOptimizer):
    """ZeRO-2: :class:`~.stage1.ShardedOptimizer` whose gradients are reduce-scattered in
    buckets of ``bucket_cap_mb`` during backward and freed outside this rank's shard."""

    def __init__(
        self, params, optimizer_class, process_group=None, bucket_cap_mb: float = 25.0, **defaults
    ):
        self._cap_mb = bucket_cap_mb
        super().__init__(params, optimizer_class, process_group=process_group, **defaults)
        self._pending = []  # (work, output, group index, bucket index) in launch order
        self._hooks = []
        for gi, buckets in enumerate(self.buckets):
            self._watch(gi, buckets)

    @property
    def bucket_cap_numel(self) -> int:
        p = next(p for g in self.param_groups for p in g["params"])
        return max(1, int(self._cap_mb * 2**20) // p.element_size())

    def _bucket_order(self, params):
        return list(reversed(params))  # backward produces the last layer's gradients first

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self._ready:
            self._watch(len(self.buckets) - 1, self.buckets[-1])

    # --- during backward ----------------------------------------------------------------------
    def _watch(self, gi: int, buckets: list[Bucket]) -> None:
        if not hasattr(self, "_fill"):
            self._fill = {}  # (gi, bi) -> [flat gradient buffer, set of parameter ids arrived]
            self._launched = []  # per group: how many of its buckets were launched this step
            self._where = {}  # parameter id -> (gi, bi, offset)
        self._launched.append(0)
        for bi, b in enumerate(buckets):
            for p, o in zip(b.params, b.offsets):
                self._where[id(p)] = (gi, bi, o)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        gi, bi, o = self._where[id(p)]
        b = self.buckets[gi][bi]
        if (gi, bi) not in self._fill:
            self._fill[gi, bi] = [torch.zeros(b.padded, dtype=p.dtype, device=p.device), set()]
        flat, arrived = self._fill[gi, bi]
        flat[o : o + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None  # freed: from here on only the bucket holds it
        arrived.add(id(p))
        self._launch_ready(gi)

    def _launch_ready(self, gi: int, everything: bool = False) -> None:
        """Launch group ``gi``'s buckets in order, as long as they are complete (or all of them)."""
        buckets = self.buckets[gi]
        while self._launched[gi] < len(buckets):
            bi = self._launched[gi]
            fill = self._fill.get((gi, bi))
            complete = fill is not None and len(fill[1]) == len(buckets[bi].params)
            if not (complete or everything):
                return
            if fill is None:  # no gradient at all this step
                fill = [torch.zeros(buckets[bi].padded, dtype=self.flats[gi][bi].dtype,
                                    device=self.flats[gi][bi].device), set()]  # fmt: skip
            flat = self._fill.pop((gi, bi), fill)[0]
            out = torch.empty(buckets[bi].shard_numel, dtype=flat.dtype, device=flat.device)
            traffic.note("reduce_scatter", flat.numel() * flat.element_size(), self.n)
            work = dist.reduce_scatter_tensor(out, flat, group=self.group, async_op=True)
            self._pending.append((work, out, flat, gi, bi))  # flat kept alive until it is sent
            self._launched[gi] += 1

    # --- the step -----------------------------------------------------------------------------
    def _finish_reduction(self) -> None:
        for gi in range(len(self.buckets)):
            self._launch_ready(gi, everything=True)
        for work, out, _flat, gi, bi in self._pending:
            work.wait()
            shard = self.shards[gi][bi]
            out.div_(self.n)
            shard.grad = out if shard.grad is None else shard.grad.add_(out)
        self._pending.clear()
        self._launched = [0] * len(self.buckets)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._finish_reduction()
        self._sync_options()
        self.optim.step()
        self._gather_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradient shards; each step's reduce-scatters start from nothing."""
        super().zero_grad(set_to_none=set_to_none)
        for shards in self.shards:
            for s in shards:
                s.grad = None
