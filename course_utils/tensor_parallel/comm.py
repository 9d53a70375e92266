"""What tensor parallelism sends: Megatron-LM's ``f`` and ``g``, and sequence parallelism's pair.

Each is an autograd function: one collective in forward, its conjugate in backward. ``t`` is the
tensor-parallel degree (the group's size); ``(B, T, h)`` activations, the sequence on dim 1.

==================================  =====================  =====================
function                            forward                backward
==================================  =====================  =====================
:func:`copy_to_tp` (``f``)          identity               all-reduce
:func:`reduce_from_tp` (``g``)      all-reduce             identity
:func:`gather_from_tp`              all-gather (last dim)  keep own slice
:func:`gather_from_sp`  (``g``, SP) all-gather (seq dim)   reduce-scatter
:func:`scatter_to_sp`   (``g̅``, SP) reduce-scatter (seq)   all-gather
:func:`split_to_sp`                 keep own seq slice     all-gather
==================================  =====================  =====================

Shoeybi et al. 2019 (Megatron-LM, §3) name ``f`` and ``g``; Korthikanti et al. 2022 (§4.2.2)
replace each all-reduce by the all-gather / reduce-scatter pair, which moves the same bytes.
Taught in notebook 06, where ``f`` and ``g`` are also written inline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1
"""The sequence dimension of ``(B, T, h)`` activations."""


def _size(group) -> int:
    return dist.get_world_size(group)


def all_gather_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order (one all-gather)."""
    n = _size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()  # gather along dim 0, then put dim back
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's contiguous slice along ``dim`` (one reduce-scatter)."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def own_slice(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication)."""
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {n} ranks")
    return x.chunk(n, dim)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    """``f``: forward identity; backward all-reduce of the input's gradient (``B·T·h`` numbers)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if _size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """``g``: forward all-reduce of the partial sums (``B·T·h`` numbers); backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()  # never reduce into a tensor autograd may have saved
        if _size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward all-gather along the last dimension; backward keeps this rank's slice (no comm)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return own_slice(grad, grad.dim() - 1, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """Forward all-gather along the sequence; backward reduce-scatter along the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, SEQ_DIM, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """Forward reduce-scatter along the sequence; backward all-gather along the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, SEQ_DIM, ctx.group), None


class _SplitToSP(torch.autograd.Function):
    """Forward keeps this rank's slice of the sequence (no comm); backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_slice(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce backward. Before a column-parallel layer."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward, identity backward. After a row-parallel layer."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather a last-dimension-sharded tensor (a column-parallel output asked to gather)."""
    return _GatherFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's ``g``: all-gather the sequence forward, reduce-scatter backward."""
    return _GatherFromSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's ``g̅``: reduce-scatter the sequence forward, all-gather backward."""
    return _ScatterToSP.apply(x, group)


def split_to_sp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a sequence-parallel region from a replicated tensor: slice forward, all-gather backward."""
    return _SplitToSP.apply(x, group)


__all__ = [
    "SEQ_DIM",
    "all_gather_dim",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "own_slice",
    "reduce_from_tp",
    "reduce_scatter_dim",
    "scatter_to_sp",
    "split_to_sp",
]
