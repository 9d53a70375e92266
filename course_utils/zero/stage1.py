"""ZeRO stage 1 (P_os): each rank keeps the optimizer state of its shard only.

One step, for each flat bucket of ``Ψ`` parameters (``n`` ranks):

1. **reduce-scatter** the gradients: rank ``r`` receives the sum of shard ``r``'s gradients
   (``Ψ`` moved), divided by ``n`` to average them;
2. the wrapped optimizer (Adam, SGD…) steps shard ``r`` only: its state is ``1/n`` of the model's;
3. **all-gather** the updated shards, so every rank holds all the parameters again (``Ψ``).

``2Ψ`` in all, the same as plain data parallelism's all-reduce: stage 1 cuts optimizer memory by
``n`` for free. The naive order (``gradient_reduction="all_reduce"``: all-reduce, ``2Ψ``, then the
all-gather, ``Ψ``) sends ``3Ψ``. With ``"none"`` the gradients are used as they are, already
averaged by ``DistributedDataParallel``: what torch's ``ZeroRedundancyOptimizer`` expects.

:class:`ShardedOptimizer` has the interface of ``torch.distributed.optim.ZeroRedundancyOptimizer``:

    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()
    opt.consolidate_state_dict(to=0)   # then, on rank 0: opt.state_dict()

The parameters live in flat padded buckets (:mod:`.flat`): each parameter becomes a view of its
bucket, and each rank's shard is a view too, so the all-gather writes the model's parameters in
place. Tied parameters are stored once; frozen ones (``requires_grad=False``) stay out, as
torch's optimizers skip them. A trainable parameter without a gradient on every rank is stepped
with a zero gradient: freeze it to keep it out.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from . import traffic
from .flat import Bucket, split_buckets, unique_trainable

REDUCTIONS = ("reduce_scatter", "all_reduce", "none")


def reduce_scatter_mean(flat: torch.Tensor, bucket: Bucket, group) -> torch.Tensor:
    """This rank's shard of the mean of ``flat`` over ranks: one reduce-scatter (``Ψ``)."""
    n = bucket.n
    out = torch.empty(bucket.shard_numel, dtype=flat.dtype, device=flat.device)
    traffic.note("reduce_scatter", flat.numel() * flat.element_size(), n)
    dist.reduce_scatter_tensor(out, flat, group=group)
    return out.div_(n)


def all_gather_shards(flat: torch.Tensor, shard: torch.Tensor, bucket: Bucket, group) -> None:
    """Every rank's shard into ``flat`` (one all-gather, ``Ψ``)."""
    traffic.note("all_gather", flat.numel() * flat.element_size(), bucket.n)
    dist.all_gather_into_tensor(flat, shard.detach().clone(), group=group)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: ``optimizer_class(shard, **defaults)`` per rank, gradients reduce-scattered,
    parameters all-gathered. ``process_group``: the data-parallel group (default: all ranks)."""

    bucket_cap_numel: int | None = None  # stage 1: one bucket per parameter group

    def __init__(
        self,
        params,
        optimizer_class: type[torch.optim.Optimizer],
        process_group=None,
        parameters_as_bucket_view: bool = True,
        gradient_reduction: str = "reduce_scatter",
        **defaults,
    ):
        if gradient_reduction not in REDUCTIONS:
            raise ValueError(
                f"gradient_reduction must be one of {REDUCTIONS}, not {gradient_reduction!r}"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} shards over a process group: call it inside a rank "
                "(course_utils.launch, torchrun), after the process group exists"
            )
        self.group = process_group
        self.n, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.gradient_reduction = gradient_reduction
        self.parameters_as_bucket_view = parameters_as_bucket_view  # always: buckets are views
        self.optimizer_class = optimizer_class
        self._ready = False
        super().__init__(params, defaults)
        # per outer group: its buckets, their flat parameter buffers and this rank's shards
        self.buckets: list[list[Bucket]] = []
        self.flats: list[list[torch.Tensor]] = []
        self.shards: list[list[torch.nn.Parameter]] = []
        for group in self.param_groups:
            self._shard_group(group)
        self.optim = optimizer_class(
            [self._inner_group(i, g) for i, g in enumerate(self.param_groups)], **defaults
        )
        self._consolidated = None
        self._ready = True

    # --- layout -------------------------------------------------------------------------------
    def _shard_group(self, group) -> None:
        params = unique_trainable(group["params"])
        buckets = split_buckets(self._bucket_order(params), self.n, self.bucket_cap_numel)
        flats, shards = [], []
        for b in buckets:
            flat = b.flatten([p.detach() for p in b.params])
            for p, view in zip(b.params, b.views(flat)):
                p.data = view  # the parameter now lives in the bucket
            lo, hi = b.shard_range(self.rank)
            flats.append(flat)
            shards.append(torch.nn.Parameter(flat[lo:hi]))  # a view: stepping it writes flat
        self.buckets.append(buckets)
        self.flats.append(flats)
        self.shards.append(shards)

    def _bucket_order(self, params):
        return params

    def _inner_group(self, i: int, group) -> dict:
        return {**{k: v for k, v in group.items() if k != "params"}, "params": self.shards[i]}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self._ready:
            self._shard_group(self.param_groups[-1])
            i = len(self.param_groups) - 1
            self.optim.add_param_group(self._inner_group(i, self.param_groups[-1]))

    # --- the step -----------------------------------------------------------------------------
    def _shard_gradient(self, gi: int, bi: int) -> torch.Tensor:
        """This rank's averaged gradient shard of bucket ``bi`` of group ``gi``."""
        b = self.buckets[gi][bi]
        flat = b.flatten([p.grad for p in b.params])
        lo, hi = b.shard_range(self.rank)
        if self.gradient_reduction == "reduce_scatter":
            return reduce_scatter_mean(flat, b, self.group)
        if self.gradient_reduction == "all_reduce":  # the naive way: every rank gets everything
            traffic.note("all_reduce", flat.numel() * flat.element_size(), self.n)
            dist.all_reduce(flat, group=self.group)
            return flat[lo:hi].div_(self.n)
        return flat[lo:hi]  # already averaged (DDP)

    def _sync_options(self) -> None:
        """Options changed on ``param_groups`` (a learning-rate scheduler) reach the shards."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_options()
        for gi, shards in enumerate(self.shards):
            for bi, shard in enumerate(shards):
                shard.grad = self._shard_gradient(gi, bi)
        self.optim.step()
        for shards in self.shards:
            for shard in shards:
                shard.grad = None  # the gradient shard was only needed for the step
        self._gather_parameters()
        return loss

    def _gather_parameters(self) -> None:
        """Every rank's updated shards into the flat buffers, bucket by bucket (``Ψ``)."""
        for gi, buckets in enumerate(self.buckets):
            for b, flat, shard in zip(buckets, self.flats[gi], self.shards[gi]):
                all_gather_shards(flat, shard, b, self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.optim.zero_grad(set_to_none=set_to_none)

    # --- state dicts --------------------------------------------------------------------------
    def _flat_states(self):
        """(group, bucket, shard, state) for every shard that has optimizer state."""
        for gi, shards in enumerate(self.shards):
            for bi, shard in enumerate(shards):
                yield gi, bi, shard, self.optim.state.get(shard, {})

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (a collective: every rank calls it)."""
        state: dict[int, dict] = defaultdict(dict)
        index = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        for gi, bi, shard, st in self._flat_states():
            b = self.buckets[gi][bi]
            for key, value in st.items():
                if torch.is_tensor(value) and value.numel() == shard.numel() and value.dim() == 1:
                    full = torch.empty(b.padded, dtype=value.dtype, device=value.device)
                    traffic.note("all_gather", full.numel() * full.element_size(), self.n)
                    dist.all_gather_into_tensor(full, value.contiguous(), group=self.group)
                    for p, view in zip(b.params, b.views(full)):
                        state[index[id(p)]][key] = view.clone()
                else:  # a scalar such as Adam's step: the same for every parameter of the shard
                    for p in b.params:
                        state[index[id(p)]][key] = (
                            value.clone() if torch.is_tensor(value) else value
                        )
        groups = []
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = [index[id(p)] for p in group["params"]]
            groups.append(g)
        mine = dist.get_rank(self.group) == to
        self._consolidated = {"state": dict(state), "param_groups": groups} if mine else None
        self._consolidated_on = to

    def state_dict(self) -> dict:
        """The consolidated state, in the format of ``optimizer_class``'s own state dict."""
        if self._consolidated is None:
            raise RuntimeError(
                "call consolidate_state_dict(to=rank) on every rank first; the state dict is then "
                "available on that rank only (as torch's ZeroRedundancyOptimizer)"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole (consolidated, or single-process ``optimizer_class``) state dict: each rank
        keeps its shard."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}"
            )
        index = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        for outer, saved in zip(self.param_groups, groups):
            outer.update({k: v for k, v in saved.items() if k != "params"})
        self._sync_options()
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        for gi, shards in enumerate(self.shards):
            for bi, shard in enumerate(shards):
                b = self.buckets[gi][bi]
                per_param = [saved_state.get(index[id(p)], {}) for p in b.params]
                keys = {k for s in per_param for k in s}
                if not keys:
                    continue
                lo, hi = b.shard_range(self.rank)
                st = {}
                for key in keys:
                    values = [s.get(key) for s in per_param]
                    first = next(v for v in values if v is not None)
                    if torch.is_tensor(first) and first.dim() > 0:
                        flat = b.flatten(
                            [v for v in values], dtype=first.dtype, device=shard.device
                        )
                        st[key] = flat[lo:hi].clone()
                    else:
                        st[key] = (
                            first.clone().to(first.device) if torch.is_tensor(first) else first
                        )
                self.optim.state[shard] = st
