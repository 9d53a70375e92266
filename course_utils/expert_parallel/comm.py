"""What expert parallelism sends: token counts, then the tokens, with ``all_to_all_single``.

- :func:`exchange_counts`: each rank tells every other how many of its tokens go to each of that
  rank's experts (an all-to-all of ``E`` integers per rank), so that receive buffers can be sized.
- :func:`all_to_all`: rows of a (N, h) tensor to the ranks of ``group``, ``send_splits[j]`` rows to
  rank ``j``, ``recv_splits[j]`` rows from it (splits may differ from rank to rank and be 0). Its
  backward is the same exchange reversed: each row's gradient goes back to where the row came
  from.

Both use ``all_to_all_single``: one flat buffer on every backend. The list form ``all_to_all``
was long missing from gloo (pytorch issue 88245): the pinned torch has it, the 2.6 floor does not.
Taught in notebook 10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """``counts`` (E,): this rank's tokens per expert, experts spread evenly over the ``n`` ranks
    of ``group`` (rank ``j`` holds experts ``j·E/n .. (j+1)·E/n − 1``). Returns (n, E/n): row
    ``s`` = the tokens rank ``s`` sends to each of this rank's experts."""
    n = dist.get_world_size(group)
    send = counts.reshape(n, -1).contiguous()  # row j: for rank j's experts
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _exchange(x, send_splits, recv_splits, group):
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x, send_splits: list[int], recv_splits: list[int], group=None):
    """Rows of ``x`` (N, h) exchanged between the ranks of ``group`` (see the module)."""
    if sum(send_splits) != x.shape[0]:
        raise ValueError(f"send_splits sum to {sum(send_splits)}, but x has {x.shape[0]} rows")
    if not (torch.is_grad_enabled() and x.requires_grad):  # no graph to record (and the profiler
        return _exchange(x, list(send_splits), list(recv_splits), group)  # sees a plain c10d op)
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)
