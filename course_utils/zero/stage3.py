"""ZeRO stage 3 (P_os+g+p): parameters sharded too, gathered one unit at a time.

The model is cut into **units** (by default each module that holds parameters of its own; FSDP
calls them wrapping units). Each unit's parameters live in one flat padded bucket, of which a rank
keeps only its shard: ``Ψ/n`` of the parameters, gradients and optimizer state in all. Then, per
unit and per step:

- **before its forward**: all-gather the unit (``Ψ`` over all units), run, free it again;
- **before its backward**: all-gather it again (``Ψ``), a hook on the unit's output does it;
- **after its backward**: reduce-scatter its gradients into this rank's shard (``Ψ``) and free the
  full gradients and parameters.

``3Ψ`` per step, 1.5× plain data parallelism, for ``16Ψ/n`` of model state. At any moment a rank
holds its shards plus the units being used: peak parameter memory ``Σψ/n + max ψᵢ`` (Zhao et al.
2023, §3.2), so finer units mean less memory and more, smaller collectives.

    model = ShardedModel(GPT(cfg), units=list(gpt.blocks))   # or units=None: every module
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)      # the shards: ordinary Parameters
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
    model.full_parameters()                                  # name -> full tensor (all ranks)

The modules keep their own ``nn.Parameter`` objects, so their code is unchanged; between uses
their flat buffer's storage is resized to zero bytes (as FSDP does). A parameter used by two
units (tied weights) belongs to the root unit, gathered for the whole step. Frozen parameters
stay whole on every rank. Every rank must use the same parameters in a step (FSDP's rule).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import traffic
from .flat import Bucket, unique_trainable


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


class Unit:
    """One unit: its parameters as views of one flat buffer, this rank's shard of it, and whether
    the buffer holds the parameters now. Freeing resizes the buffer's storage to zero bytes (as
    FSDP does), so views that autograd saved for backward are freed too and see the data again
    once it is gathered."""

    def __init__(self, name: str, params: list[nn.Parameter], n: int, rank: int, group):
        self.name, self.group, self.rank = name, group, rank
        self.bucket = Bucket.of(params, n)
        self.flat = self.bucket.flatten([p.detach() for p in params])
        lo, hi = self.bucket.shard_range(rank)
        self.shard = nn.Parameter(self.flat[lo:hi].clone())  # the only copy this rank keeps
        for p, view in zip(params, self.bucket.views(self.flat)):
            p.data = view
        self.arrived: set[int] = set()
        self.gathered = True
        self.free()

    def gather(self) -> None:
        """All-gather the unit's parameters (``ψ``) into its buffer."""
        if self.gathered:
            return
        flat = self.flat
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        traffic.note("all_gather", flat.numel() * flat.element_size(), self.bucket.n)
        dist.all_gather_into_tensor(flat, self.shard.detach(), group=self.group)
        self.gathered = True

    def free(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_gradients(self) -> None:
        """Reduce-scatter the unit's gradients (``ψ``) into the shard's, then free them all."""
        b = self.bucket
        flat = b.flatten([p.grad for p in b.params], dtype=self.shard.dtype)
        out = torch.empty(b.shard_numel, dtype=flat.dtype, device=flat.device)
        traffic.note("reduce_scatter", flat.numel() * flat.element_size(), b.n)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        out.div_(b.n)
        self.shard.grad = out if self.shard.grad is None else self.shard.grad.add_(out)
        for p in b.params:
            p.grad = None
        self.arrived.clear()
        self.free()


class ShardedModel(nn.Module):
    """ZeRO-3 around ``module``: see the module docstring. ``units``: the submodules that are
    gathered one at a time (default: every module owning parameters directly)."""

    def __init__(self, module: nn.Module, units: list[nn.Module] | None = None, process_group=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedModel shards over a process group: build it inside a rank "
                "(course_utils.launch, torchrun), after the process group exists"
            )
        self.__dict__["module"] = module  # not a submodule: parameters() are the shards only
        self.group = process_group
        n, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        if units is None:
            units = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
        names = {m: name or "(root)" for name, m in module.named_modules()}
        for u in units:
            if u not in names:
                raise ValueError(f"unit {type(u).__name__} is not a submodule of the model")
        # each parameter belongs to the innermost unit around the module that registers it; one
        # registered under two units (tied weights) or under none goes to the root unit
        index = {id(u): i for i, u in enumerate(units)}
        enclosing: dict[int, int | None] = {}

        def walk(m: nn.Module, current: int | None) -> None:
            current = index.get(id(m), current)
            enclosing[id(m)] = current
            for child in m.children():
                if id(child) not in enclosing:
                    walk(child, current)

        walk(module, None)
        owners: dict[int, set] = {}
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), set()).add(enclosing[id(m)])
        by_unit: list[list[nn.Parameter]] = [[] for _ in units]
        root: list[nn.Parameter] = []
        for p in unique_trainable(module.parameters()):
            (o,) = owners[id(p)] if len(owners[id(p)]) == 1 else (None,)
            (root if o is None else by_unit[o]).append(p)
        self.units: list[Unit] = []
        self._root = Unit("(root)", root, n, rank, process_group) if root else None
        for u, params in zip(units, by_unit):
            if params:
                unit = Unit(names[u], params, n, rank, process_group)
                self.units.append(unit)
                u.register_forward_pre_hook(lambda m, a, unit=unit: unit.gather())
                u.register_forward_hook(lambda m, a, out, unit=unit: self._after_forward(unit, out))
        self.shards = nn.ParameterList(
            [u.shard for u in ([self._root] if self._root else []) + self.units]
        )
        self._of = {}
        for unit in ([self._root] if self._root else []) + self.units:
            for p in unit.bucket.params:
                self._of[id(p)] = unit
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _after_forward(self, unit: Unit, out):
        unit.free()
        tensors = out if isinstance(out, tuple | list) else (out,)
        for t in tensors:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g, unit=unit: (unit.gather(), g)[1])

    def _on_grad(self, p: torch.Tensor) -> None:
        unit = self._of[id(p)]
        unit.arrived.add(id(p))
        if len(unit.arrived) == len(unit.bucket.params) and unit is not self._root:
            unit.reduce_gradients()

    @property
    def root(self) -> Unit | None:
        """The unit of the parameters that belong to no smaller unit (gathered for the whole step)."""
        return self._root

    def forward(self, *args, **kwargs):
        if self._root is not None:
            self._root.gather()
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Reduce what backward left: the root unit, and units with unused parameters (in unit
        order, so every rank calls the same collectives). Call before the optimizer step."""
        for unit in ([self._root] if self._root else []) + self.units:
            if unit.arrived or unit.gathered:
                unit.gather()
                unit.reduce_gradients()

    def train(self, mode: bool = True):
        self.module.train(mode)
        return super().train(mode)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by name (all-gathers each unit: call on every rank)."""
        out = {}
        for unit in ([self._root] if self._root else []) + self.units:
            was = unit.gathered
            unit.gather()
            for p in unit.bucket.params:
                out[id(p)] = p.detach().clone()  # a copy: the buffer may be freed below
            if not was:
                unit.free()
        return {name: out.get(id(p), p.detach()) for name, p in self.module.named_parameters()}
