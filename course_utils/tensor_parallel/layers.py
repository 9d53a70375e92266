"""Megatron-LM's tensor-parallel layers, cut from ordinary single-device layers.

Each layer's ``weight`` and ``bias`` are this rank's shards, as plain ``Parameter``s: contiguous
and in rank order, as torch's ``ColwiseParallel`` / ``RowwiseParallel`` cut them. ``t`` is the
tensor-parallel degree; activations are ``(B, T, features)``.

What travels (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.2 for sequence parallelism):

- :class:`ColumnParallelLinear`: output features sharded (``W`` split by rows of ``out x in``).
  Forward: ``f`` (nothing), the matmul, and the output stays sharded unless ``gather_output``
  (an all-gather). Backward: ``f``'s all-reduce of the input gradient. With sequence parallelism
  the input arrives sharded by sequence: forward all-gathers it (``g``), backward reduce-scatters
  the input gradient and all-gathers the input once more (only the shard is kept for backward).
- :class:`RowParallelLinear`: input features sharded. Forward: the matmul gives partial sums, ``g``
  all-reduces them (sequence parallel: reduce-scatters them), then the bias is added once.
  Backward: nothing (sequence parallel: an all-gather of the output gradient).
- :class:`VocabParallelEmbedding`: rows of the table sharded by token id; each rank looks up the
  ids it owns, zeros the rest, and ``g`` sums (sequence parallel: reduce-scatters).

Column then row costs one all-reduce forward and one backward: the MLP's and attention's pattern.
Taught in notebook 06.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .comm import (
    SEQ_DIM,
    all_gather_dim,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_dim,
    scatter_to_sp,
)


def _shard_rows(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return t.detach().chunk(n, dim)[r].clone()


def _same_requires_grad(layer: nn.Module, full: nn.Module) -> None:
    """A frozen weight or bias stays frozen in its shard."""
    for name, p in layer.named_parameters(recurse=False):
        p.requires_grad_(getattr(full, name).requires_grad)


def reduce_grad_over_tp(param: nn.Parameter, group=None) -> None:
    """A parameter replicated on every rank but fed different data (a LayerNorm or a bias in a
    sequence-parallel region): all-reduce its gradient over the group as backward produces it.

    The hook sees each backward's gradient before it is accumulated into ``.grad``, so gradient
    accumulation over several backward passes stays correct.
    """

    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)
    param.sequence_parallel = True


class _AllGatherLinear(torch.autograd.Function):
    """``y = all_gather_seq(x) @ W^T + b``, keeping only the sequence shard ``x`` for backward.

    Forward: one all-gather along the sequence. Backward: the input again (all-gather), for the
    weight gradient; the input gradient is reduce-scattered along the sequence. Megatron-LM does
    the same, so that activation memory stays ``1/t`` (Korthikanti et al. 2022, §4.2.2).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):  # x: (B, T/t, in) -> (B, T, out/t)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_dim(x, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, out/t)
        x, weight = ctx.saved_tensors
        full = all_gather_dim(x, SEQ_DIM, ctx.group)  # (B, T, in), gathered again
        grad_in = reduce_scatter_dim(grad @ weight, SEQ_DIM, ctx.group)  # (B, T/t, in)
        grad_w = grad.flatten(0, -2).t() @ full.flatten(0, -2)  # (out/t, in)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_in, grad_w, grad_b, None


class ColumnParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W``'s output features (and ``b``) cut into ``t`` contiguous shards.

    ``weight``: ``(out/t, in)``, ``bias``: ``(out/t,)``. Output ``(..., out/t)``, or ``(..., out)``
    with ``gather_output=True``. ``sequence_parallel=True``: the input is ``(B, T/t, in)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        t = dist.get_world_size(group)
        if out_features % t:
            raise ValueError(
                f"ColumnParallelLinear: out_features={out_features} does not split over t={t} ranks"
            )
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features // t, **kw)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (rows ``r·out/t .. (r+1)·out/t`` of its weight)."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group,
            device=w.device,
            dtype=w.dtype,
            **kwargs,
        )
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(w, 0, group))
            if linear.bias is not None:
                layer.bias.copy_(_shard_rows(linear.bias, 0, group))
        _same_requires_grad(layer, linear)
        return layer

    def forward(self, x):  # (B, T, in) or (B, T/t, in) -> (B, T, out/t)
        if self.sequence_parallel:
            y = _AllGatherLinear.apply(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        t = dist.get_world_size(self.group)
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.out_features // t}), "
            f"t={t}, gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r W_r^T + b``: ``W``'s input features cut into ``t`` contiguous shards.

    ``weight``: ``(out, in/t)``; ``bias``: ``(out,)``, whole, added once after the reduction.
    Input ``(..., in/t)`` (a column-parallel output), output ``(..., out)``; with
    ``sequence_parallel=True`` the output is reduce-scattered to ``(B, T/t, out)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        t = dist.get_world_size(group)
        if in_features % t:
            raise ValueError(
                f"RowParallelLinear: in_features={in_features} does not split over t={t} ranks"
            )
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.sequence_parallel = sequence_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        if self.bias is not None and sequence_parallel:
            reduce_grad_over_tp(self.bias, group)  # added to this rank's part of the sequence only

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs) -> RowParallelLinear:
        """This rank's shard of ``linear`` (columns ``r·in/t .. (r+1)·in/t``; the whole bias)."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group,
            device=w.device,
            dtype=w.dtype,
            **kwargs,
        )
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(w, 1, group))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        _same_requires_grad(layer, linear)
        return layer

    def forward(self, x):  # (B, T, in/t) -> (B, T, out) or (B, T/t, out)
        partial = F.linear(x, self.weight)  # this rank's partial sum, (B, T, out)
        if self.sequence_parallel:
            y = scatter_to_sp(partial, self.group)
        else:
            y = reduce_from_tp(partial, self.group)
        return y + self.bias if self.bias is not None else y  # the bias once, after the sum

    def extra_repr(self) -> str:
        t = dist.get_world_size(self.group)
        return (
            f"in={self.in_features} (local {self.in_features // t}), out={self.out_features}, "
            f"t={t}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table cut by token id: rank ``r`` holds rows ``r·V/t .. (r+1)·V/t``.

    Each rank looks up the ids it owns, writes zeros for the others, and ``g`` sums the ranks'
    outputs (all-reduce of ``B·T·h`` numbers; sequence parallel: reduce-scatter). Backward sends
    nothing: each rank's rows get the gradient of the ids it owns.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if num_embeddings % t:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} does not split over t={t} ranks"
            )
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel = sequence_parallel
        self.start, self.end = r * num_embeddings // t, (r + 1) * num_embeddings // t
        self.weight = nn.Parameter(
            torch.empty(num_embeddings // t, embedding_dim, device=device, dtype=dtype)
        )

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None, **kwargs) -> VocabParallelEmbedding:
        w = emb.weight
        layer = cls(
            emb.num_embeddings, emb.embedding_dim, group, device=w.device, dtype=w.dtype, **kwargs
        )
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(w, 0, group))
        _same_requires_grad(layer, emb)
        return layer

    def forward(self, idx):  # (B, T) ids -> (B, T, h), or (B, T/t, h) with sequence parallelism
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return scatter_to_sp(out, self.group)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows {self.start}..{self.end - 1}"


__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "reduce_grad_over_tp",
]
