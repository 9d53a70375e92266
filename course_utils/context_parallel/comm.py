"""What context parallelism sends: the ring's point-to-point passes, Ulysses' all-to-alls, and
the all-gather of K/V.

- :class:`Ring`: each rank sends tensors to the next rank of the group and receives the same
  number from the previous one, all in one ``batch_isend_irecv`` (so no pair of neighbours waits
  on each other), started before the block's compute and waited for after it (the overlap ring
  attention is built on).
- :func:`seq_to_head` / :func:`head_to_seq`: DeepSpeed-Ulysses' two all-to-alls
  (``all_to_all_single``), each the other's backward.
- :func:`all_gather_seq`: every rank's K or V gathered whole (forward), the gradient
  reduce-scattered back (backward): the "all-gather K/V" context parallelism of Llama 3.

Taught in notebook 09.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ring:
    """Point-to-point passes around the ranks of ``group`` (None: every rank), in group order."""

    def __init__(self, group=None):
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(self.n)
        ranks = list(ranks)
        self.next = ranks[(self.rank + 1) % self.n]  # global ranks, as P2POp wants them
        self.prev = ranks[(self.rank - 1) % self.n]
        self.works = []

    def start(self, *tensors):
        """Send ``tensors`` to the next rank and post receives of the same shapes from the
        previous one, in one batch; returns the receive buffers (valid after :meth:`wait`)."""
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        self.works = dist.batch_isend_irecv(ops)
        return bufs

    def wait(self):
        for w in self.works:
            w.wait()
        self.works = []


def _seq_to_head(x, group):
    """(B, H, s, D) with this rank's s = S/P tokens -> (B, H/P, S, D): this rank's heads, every
    token, the ranks' sequence pieces in rank order."""
    p = dist.get_world_size(group)
    B, H, s, D = x.shape
    send = x.reshape(B, p, H // p, s, D).transpose(0, 1).contiguous()  # (P, B, H/P, s, D)
    recv = torch.empty_like(send)  # recv[j]: rank j's tokens of this rank's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // p, p * s, D)  # (B, H/P, S, D)


def _head_to_seq(x, group):
    """(B, H/P, S, D) -> (B, H, S/P, D): the inverse of :func:`_seq_to_head`."""
    p = dist.get_world_size(group)
    B, h, S, D = x.shape
    send = x.reshape(B, h, p, S // p, D).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, H/P, s, D)
    recv = torch.empty_like(send)  # recv[j]: this rank's tokens of rank j's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(B, p * h, S // p, D)  # (B, H, s, D)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.group), None


def seq_to_head(x, group=None):
    """All-to-all from sequence-sharded (B, H, S/P, D) to head-sharded (B, H/P, S, D); its
    backward is the reverse all-to-all. ``H`` must be a multiple of the group's size."""
    p = dist.get_world_size(group)
    if x.shape[1] % p:
        raise ValueError(
            f"Ulysses gives each of {p} ranks H/{p} whole heads, but the tensor has "
            f"H={x.shape[1]} heads: use a context-parallel degree that divides {x.shape[1]} (or "
            "ring attention, which has no such limit)"
        )
    return _SeqToHead.apply(x, group)


def head_to_seq(x, group=None):
    """All-to-all from head-sharded (B, H/P, S, D) back to sequence-sharded (B, H, S/P, D)."""
    return _HeadToSeq.apply(x, group)


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        p = dist.get_world_size(group)
        out = torch.empty((p * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)  # stacked along dim 0
        return out.view(p, *x.shape)  # (P, B, H, s, D): rank j's piece at [j]

    @staticmethod
    def backward(ctx, grad):  # every rank's gradient for my piece, summed: a reduce-scatter
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


def all_gather_seq(x, group=None):
    """Every rank's (B, H, s, D) piece, stacked (P, B, H, s, D); backward reduce-scatters."""
    return _AllGatherSeq.apply(x, group)
