"""Expert parallelism applied to a single-device :class:`~.layer.MoE` from outside.

Each of the ``n`` ranks of the expert-parallel group keeps ``E/n`` of the experts (rank ``j``:
experts ``j·E/n .. (j+1)·E/n − 1``) and a whole copy of the router. A forward, on every rank:

1. route this rank's tokens (:func:`~.router.route`, capacity counted on this rank's tokens);
2. **dispatch**: sort the kept assignments by expert, tell every rank how many rows it will get
   (:func:`~.comm.exchange_counts`), and send each row to the rank holding its expert
   (``all_to_all_single`` with uneven splits);
3. run the local experts, each on the rows it received from every rank;
4. **combine**: send each result back where its row came from (the reverse all-to-all), and add
   it to its token's output with the routing weight.

What travels per layer and rank, forward: the kept assignments whose expert lives elsewhere, one
``h``-vector each, out in the dispatch and back in the combine (``2·T·k·h·(n−1)/n`` values with
an even load); backward the same again, reversed. Expert gradients are complete on their rank for
the tokens of its EP group; data parallelism then reduces them over the ranks holding the same
experts (:func:`sync_gradients`). Taught in notebook 10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_to_all, exchange_counts
from .layer import MoE


def dispatch_combine(x2, routing, local_experts, n_experts: int, group=None, stats=None):
    """Steps 2 to 4 above for this rank's tokens ``x2`` (T, h) routed by ``routing``: returns the
    MoE's output (T, h). ``local_experts``: this rank's ``E/n`` experts, in order. ``stats``, a
    dict, receives the rows sent to other ranks and the rows each local expert ran on."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    per_rank = n_experts // n
    t, j = torch.nonzero(routing.keep, as_tuple=True)  # kept assignments, token order
    e = routing.experts[t, j]
    order = torch.argsort(e, stable=True)  # grouped by expert, so by destination rank
    t, j, e = t[order], j[order], e[order]
    counts = torch.bincount(e, minlength=n_experts)  # (E,) rows this rank sends per expert
    recv_counts = exchange_counts(counts, group)  # (n, E/n): rows from each rank per local expert
    send_splits = counts.view(n, per_rank).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    rows = all_to_all(x2[t], send_splits, recv_splits, group)  # (R, h), by source, then expert
    local = torch.arange(per_rank, device=x2.device).repeat(n)  # each (source, expert) block's id
    local = local.repeat_interleave(recv_counts.reshape(-1))  # (R,): each row's local expert
    by_expert = torch.argsort(local, stable=True)
    sizes = torch.bincount(local, minlength=per_rank).tolist()
    outs = [  # every expert runs, on no rows too: its gradient then exists, as zeros
        expert(chunk) for expert, chunk in zip(local_experts, rows[by_expert].split(sizes))
    ]
    done = torch.empty_like(rows).index_copy(0, by_expert, torch.cat(outs))  # back in row order
    back = all_to_all(done, recv_splits, send_splits, group)  # (A, h), as this rank sent them
    y = torch.zeros_like(x2).index_add(0, t, routing.weights[t, j, None] * back)
    if stats is not None:
        stats["sent_rows"] = sum(s for r, s in enumerate(send_splits) if r != me)
        stats["expert_rows"] = sizes
        stats["recv_counts"] = recv_counts.tolist()
    return y


def apply_ep(moe: MoE, group=None) -> MoE:
    """Keep this rank's ``E/n`` experts of ``moe`` (the others are deleted) and make its forward
    expert-parallel over ``group``. ``moe.expert_ids`` lists the global experts kept;
    ``moe.stats`` the last forward's traffic. ``E`` must be a multiple of the group's size."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    E = moe.cfg.n_experts
    if E % n:
        raise ValueError(
            f"expert parallelism gives each of {n} ranks E/{n} experts, but the layer has E={E}: "
            f"use a degree that divides {E}"
        )
    ids = list(range(me * E // n, (me + 1) * E // n))
    moe.experts = nn.ModuleList(moe.experts[i] for i in ids)
    moe.expert_ids, moe.stats = ids, {}

    def forward(x):  # (..., h) -> (..., h)
        x2 = x.reshape(-1, x.shape[-1])
        y = dispatch_combine(x2, moe.route(x2), moe.experts, E, group, moe.stats)
        return y.view_as(x)

    moe.forward = forward
    return moe


def sync_gradients(model: nn.Module, dense_group=None, expert_group=None, world: int | None = None):
    """Average gradients as one process on the whole batch would have them: the loss is the mean
    of every rank's, so each gradient is summed over the ranks that hold the parameter and divided
    by the number of ranks ``world``. Dense parameters (every rank holds them) are summed over
    ``dense_group``; experts (already summed over their EP group by the combine's backward) over
    ``expert_group``, the ranks holding the same experts (None: no such copies)."""
    world = world or dist.get_world_size()
    for name, p in model.named_parameters():
        if p.grad is None:  # unused here, maybe not on another rank: the collective must match
            p.grad = torch.zeros_like(p)
        is_expert = ".experts." in f".{name}"
        if is_expert and expert_group is None:
            p.grad.div_(world)
            continue
        dist.all_reduce(p.grad, group=expert_group if is_expert else dense_group)
        p.grad.div_(world)
