"""Model-state memory: the ZeRO paper's formulas, and the same quantities counted on a real model.

Rajbhandari et al. 2020 (ZeRO, §5.1 and Table 1): a model of ``Ψ`` parameters trained with
mixed-precision Adam holds, per device, ``2Ψ`` bytes of fp16 parameters, ``2Ψ`` of fp16 gradients
and ``KΨ`` of optimizer state (fp32 master parameters, momentum and variance: ``K = 12``). Over
``N`` data-parallel devices:

=====  ===========  ===========================  ==============================
stage  name         bytes per device             7.5 B parameters, N = 64
=====  ===========  ===========================  ==============================
0      DP           ``(2 + 2 + K)·Ψ``            120 GB
1      P_os         ``(2 + 2)·Ψ + K·Ψ/N``        31.4 GB
2      P_os+g       ``2Ψ + (2 + K)·Ψ/N``         16.6 GB
3      P_os+g+p     ``(2 + 2 + K)·Ψ/N``          1.9 GB
=====  ===========  ===========================  ==============================

The paper's GB is 10⁹ bytes. On CPU the course trains in float32 with Adam: 4-byte parameters and
gradients and ``K = 8`` (momentum and variance; the parameters are their own master copy), which
is also 16 bytes per parameter. :func:`count_model_states` counts what a rank really holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..measure import storage_bytes

STAGES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


def model_state_bytes(
    num_params: float,
    world_size: int,
    stage: int,
    k: float = 12,
    param_bytes: float = 2,
    grad_bytes: float = 2,
) -> float:
    """Bytes of model state per device for ZeRO ``stage`` (0 = plain data parallelism).

    ``k``: optimizer bytes per parameter (12: mixed-precision Adam; 8: float32 Adam; 4: float32
    SGD with momentum); ``param_bytes`` and ``grad_bytes``: 2 for fp16/bf16, 4 for float32."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    n, psi = world_size, num_params
    p, g, o = param_bytes * psi, grad_bytes * psi, k * psi
    if stage >= 1:
        o /= n
    if stage >= 2:
        g /= n
    if stage >= 3:
        p /= n
    return p + g + o


@dataclass
class ModelStates:
    """What one rank holds, in bytes by dtype: parameters, gradients, optimizer state."""

    parameters: dict[torch.dtype, int]
    gradients: dict[torch.dtype, int]
    optimizer: dict[torch.dtype, int]

    @property
    def total(self) -> int:
        return sum(sum(d.values()) for d in (self.parameters, self.gradients, self.optimizer))

    def bytes(self, kind: str) -> int:
        return sum(getattr(self, kind).values())


def _inner(optimizer):
    """The torch optimizer doing the steps: ``optimizer.optim`` (ShardedOptimizer, torch's
    ZeroRedundancyOptimizer), ``optimizer.optimizer`` (a wrapper holding one), or itself."""
    for name in ("optim", "optimizer"):
        inner = getattr(optimizer, name, None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer


def count_model_states(model: torch.nn.Module, optimizer=None, extra_params=()) -> ModelStates:
    """Bytes this rank holds for ``model``'s parameters and gradients and ``optimizer``'s state.

    Storage is counted once however many tensors view it (flat buckets count whole, padding
    included; a freed ZeRO-3 unit counts nothing). The parameters the optimizer steps count too
    (a sharded optimizer's shards). Works for plain modules, :class:`ShardedModel`, the sharded
    optimizers, torch's ``ZeroRedundancyOptimizer`` and FSDP2 (DTensors count their local shard)."""
    params = list(model.parameters())
    inner_model = model.__dict__.get("module")
    if inner_model is not None:  # ShardedModel: the modules' (mostly freed) parameters too
        params += list(inner_model.parameters())
    params += list(extra_params)
    inner = _inner(optimizer) if optimizer is not None else None
    if inner is not None:
        params += [q for g in inner.param_groups for q in g["params"]]
    grads = [_local(p.grad) for p in params if p.grad is not None]
    params = [_local(p) for p in params]
    state = (
        [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)] if inner else []
    )
    return ModelStates(
        storage_bytes(params), storage_bytes(grads), storage_bytes(map(_local, state))
    )


def _local(t):
    """A DTensor's local shard (FSDP2), or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t
