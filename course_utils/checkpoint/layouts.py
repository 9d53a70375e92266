"""What each rank holds, as :class:`~.sharded.Slice` s, under each of the course's layouts.

Every function returns this rank's ``(Slice, local tensor)`` pairs: the parameters under their
fully qualified names (``fc1.weight``, as in the single-device model) and the optimizer's state
beside them (``fc1.weight.exp_avg``). The same list serves to save (:func:`~.sharded.save`) and to
load (:func:`~.sharded.load` fills the tensors in place), and a checkpoint written under one layout
loads under any other, because the names and global shapes are the single-device model's:

=================  ===================================================================
layout             what rank ``r`` holds
=================  ===================================================================
:func:`replicated`  every tensor whole (DDP; saved once, by rank 0: the save deduplicates)
:func:`zero`        a flat stretch ``[r·S, (r+1)·S)`` of each bucket, parameters and optimizer
                    state, which may cut a parameter anywhere (ZeRO-1/2: then
                    :func:`zero_after_load` all-gathers the full parameters)
:func:`fsdp2`       dim-0 rows of every DTensor (``Shard(0)``), via ``to_local()``
:func:`tensor_parallel`  column layers' output rows, row layers' input columns, the rest whole
:func:`pipeline_stage`   its own layers, whole, renamed to their index in the full model
=================  ===================================================================

Optimizer hyperparameters (``param_groups``: lr, betas) are not saved: the job rebuilds its
optimizer from its configuration. A fresh optimizer has no state until its first step:
:func:`init_optimizer_state` creates it (zeros) so that a load can fill it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..zero.flat import Bucket
from ..zero.stage1 import all_gather_shards
from .sharded import Slice

Pairs = list[tuple[Slice, torch.Tensor]]


def whole(name: str, t: torch.Tensor) -> tuple[Slice, torch.Tensor]:
    """All of ``t``."""
    shape = tuple(t.shape)
    return Slice(name, shape, (0,) * len(shape), shape), t


def chunk_slice(name: str, global_shape, dim: int, rank: int, n: int) -> Slice:
    """Rank ``rank``'s piece of a tensor cut in ``n`` along ``dim`` the way ``torch.chunk`` cuts
    (pieces of ``ceil(size/n)``, the last ones shorter or empty): how Megatron's layers, DTensor's
    ``Shard(dim)`` and FSDP2 cut."""
    shape = tuple(global_shape)
    step = math.ceil(shape[dim] / n)
    lo = min(rank * step, shape[dim])
    hi = min(lo + step, shape[dim])
    offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
    lengths = tuple(hi - lo if d == dim else shape[d] for d in range(len(shape)))
    return Slice(name, shape, offsets, lengths)


def state_name(param_name: str, key: str) -> str:
    """The name of an optimizer state tensor: ``fc1.weight.exp_avg``."""
    return f"{param_name}.{key}"


def _with_state(name: str, p, s: Slice, local: torch.Tensor, optimizer) -> Pairs:
    """``(s, local)`` and the optimizer's state for ``p``: tensors like ``p`` cut like it,
    0-d ones (Adam's step) whole."""
    out = [(s, local)]
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    for key, v in state.items():
        if not torch.is_tensor(v):
            continue
        v_local = v.to_local() if hasattr(v, "to_local") else v
        if v.dim() == 0:
            out.append(whole(state_name(name, key), v_local))
        elif v_local.numel() == local.numel():
            out.append((Slice(state_name(name, key), s.global_shape, s.offsets, s.lengths, s.flat),
                        v_local))  # fmt: skip
    return out


def module_pairs(model: nn.Module, optimizer, describe: Callable) -> Pairs:
    """Every parameter (``describe(name, p) -> (Slice, local)``) with its optimizer state, then
    every buffer whole (BatchNorm's running statistics: the same on every rank)."""
    model = getattr(model, "module", model)  # DDP's wrapper adds "module." to every name
    out: Pairs = []
    for name, p in model.named_parameters():
        s, local = describe(name, p)
        out += _with_state(name, p, s, local, optimizer)
    out += [whole(name, b) for name, b in model.named_buffers()]
    return out


def replicated(model: nn.Module, optimizer=None) -> Pairs:
    """DDP: every rank holds everything. Saved by rank 0 alone (the lowest rank of identical
    slices writes them); loaded by every rank."""
    return module_pairs(model, optimizer, lambda name, p: whole(name, p.detach()))


def dtensor_pair(name: str, t) -> tuple[Slice, torch.Tensor]:
    """A DTensor on a one-dimensional mesh (``Shard(d)`` or ``Replicate()``): its
    ``to_local()`` and where that sits in the global tensor."""
    from torch.distributed.tensor import Replicate, Shard

    if t.device_mesh.ndim != 1:
        raise NotImplementedError(f"{name}: a DTensor on a {t.device_mesh.ndim}-d mesh")
    (placement,) = t.placements
    local = t.to_local()
    if isinstance(placement, Replicate):
        return whole(name, local)
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"{name}: placement {placement} (a partial sum is not a state)")
    mesh = t.device_mesh
    s = chunk_slice(name, t.shape, placement.dim, mesh.get_local_rank(), mesh.size())
    return s, local


def fsdp2(model: nn.Module, optimizer=None) -> Pairs:
    """FSDP2 (``fully_shard``): each parameter and its Adam moments are ``Shard(0)`` DTensors;
    rank ``r`` holds rows ``chunk(n, 0)[r]`` of each."""
    return module_pairs(
        model, optimizer, lambda name, p: dtensor_pair(name, p) if hasattr(p, "to_local")
        else whole(name, p.detach()),
    )  # fmt: skip


def _tp_dims(model: nn.Module) -> dict[str, int]:
    """``name -> dim`` along which the course's Megatron layers cut each parameter."""
    dims = {}
    for prefix, m in model.named_modules():
        at = f"{prefix}." if prefix else ""
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims |= {at + "weight": 0, at + "bias": 0}
        elif isinstance(m, RowParallelLinear):
            dims[at + "weight"] = 1  # its bias is whole on every rank
    return dims


def tensor_parallel(model: nn.Module, optimizer, rank: int, t: int) -> Pairs:
    """Megatron TP (:mod:`course_utils.tensor_parallel.layers`): a column layer holds rows
    ``r·out/t ..`` of its weight and bias, a row layer columns ``r·in/t ..`` of its weight; every
    other parameter is whole on every rank (and saved once)."""
    dims = _tp_dims(model)

    def describe(name, p):
        if name not in dims:
            return whole(name, p.detach())
        d = dims[name]
        shape = tuple(n * t if i == d else n for i, n in enumerate(p.shape))
        return chunk_slice(name, shape, d, rank, t), p.detach()

    return module_pairs(model, optimizer, describe)


def pipeline_stage(stage: nn.Module, optimizer, first_layer: int) -> Pairs:
    """A pipeline stage: the layers ``first_layer ..`` of an ``nn.Sequential``, held whole, named
    as in the full model (the stage's ``0.weight`` is the model's ``<first_layer>.weight``)."""

    def global_name(name: str) -> str:
        head, _, rest = name.partition(".")
        return f"{int(head) + first_layer}.{rest}"

    pairs = module_pairs(stage, optimizer, lambda name, p: whole(name, p.detach()))
    return [(Slice(global_name(s.name), s.global_shape, s.offsets, s.lengths, s.flat), t)
            for s, t in pairs]  # fmt: skip


def flat_pairs(bucket: Bucket, names: dict[int, str], flat_shard: torch.Tensor, rank: int,
               key: str | None = None) -> Pairs:  # fmt: skip
    """The stretch of each parameter inside this rank's shard of ``bucket`` (elements
    ``[r·S, (r+1)·S)`` of the flat buffer; the padding is nobody's tensor and is not saved).
    ``flat_shard``: this rank's ``S`` elements (parameters, or an optimizer state ``key``)."""
    lo, hi = bucket.shard_range(rank)
    out: Pairs = []
    for p, start in zip(bucket.params, bucket.offsets):
        a, b = max(lo, start), min(hi, start + p.numel())
        if a < b:
            name = names[id(p)] if key is None else state_name(names[id(p)], key)
            s = Slice(name, tuple(p.shape), (a - start,), (b - a,), flat=True)
            out.append((s, flat_shard.detach()[a - lo : b - lo]))
    return out


def _bucket_pairs(bucket, shard, names, rank: int, optimizer) -> Pairs:
    """A bucket's shard and the optimizer state of that shard (flat ones cut like it; a 0-d step
    saved once under each parameter the shard touches)."""
    out = flat_pairs(bucket, names, shard, rank)
    touched = [s.name for s, _ in out]
    for key, v in (optimizer.state.get(shard, {}) if optimizer is not None else {}).items():
        if torch.is_tensor(v) and v.dim() == 0:
            out += [whole(state_name(n, key), v) for n in touched]
        elif torch.is_tensor(v):
            out += flat_pairs(bucket, names, v, rank, key)
    return out


def zero(model: nn.Module, optimizer, rank: int) -> Pairs:
    """The course's ZeRO: ``optimizer`` a :class:`~course_utils.zero.ShardedOptimizer` (stage 1) or
    :class:`~course_utils.zero.ShardedGradientOptimizer` (stage 2) on ``model``, or ``model`` a
    :class:`~course_utils.zero.ShardedModel` (stage 3) with an ordinary optimizer on its shards.
    Parameters are saved from the shards too, so each rank writes ``1/n`` of everything."""
    inner_model = model.__dict__.get("module")
    if inner_model is not None:  # ZeRO-3
        names = {id(p): n for n, p in inner_model.named_parameters()}
        units = ([model.root] if model.root else []) + model.units
        pairs = [_bucket_pairs(u.bucket, u.shard, names, rank, optimizer) for u in units]
    else:  # ZeRO-1/2: the inner optimizer steps the flat shards
        names = {id(p): n for n, p in getattr(model, "module", model).named_parameters()}
        buckets = [b for group in optimizer.buckets for b in group]
        shards = [s for group in optimizer.shards for s in group]
        pairs = [_bucket_pairs(b, s, names, rank, optimizer.optim) for b, s in zip(buckets, shards)]
    return [pair for bucket in pairs for pair in bucket]


@torch.no_grad()
def zero_after_load(model: nn.Module, optimizer) -> None:
    """ZeRO-1/2 after a load: the shards hold the loaded parameters, but each rank's full copy
    (the rest of its flat buffers) still holds the old ones until an all-gather, as after a step.
    ZeRO-3 needs nothing: its units are gathered from the shards when used."""
    if model.__dict__.get("module") is not None:
        return
    for buckets, flats, shards in zip(optimizer.buckets, optimizer.flats, optimizer.shards):
        for bucket, flat, shard in zip(buckets, flats, shards):
            all_gather_shards(flat, shard, bucket, optimizer.group)


@torch.no_grad()
def init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state (zeros) so that :func:`~.sharded.load` can fill it: one
    step with zero gradients, which leaves the parameters as they are (Adam, SGD with momentum,
    no weight decay). The course's sharded optimizers: their inner optimizer steps."""
    inner = getattr(optimizer, "optim", optimizer)
    params = [p for g in inner.param_groups for p in g["params"]]
    had = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    inner.step()
    for p, g in zip(params, had):
        p.grad = g
