"""DeepSpeed-Ulysses (Jacobs et al. 2023) and all-gathered K/V: context parallelism by collectives.

**Ulysses.** Outside attention the sequence stays sharded (each rank ``S/P`` tokens, every head).
Before attention one all-to-all per tensor trades sequence for heads: each rank then holds
``H/P`` whole heads over the **whole** sequence, runs ordinary attention on them, and a last
all-to-all trades back. Per rank and layer, forward: Q, K, V and the output, four all-to-alls of
a ``b·(S/P)·h`` tensor, each sending ``(P−1)/P`` of it; the paper's ``4·N·h/P`` per link (``N``
the tokens). The degree cannot exceed the number of heads (of K/V heads with grouped-query
attention, unless K/V are copied), and the heads must divide evenly.

**All-gathered K/V** (Llama 3's context parallelism): each rank keeps its queries and gathers
every rank's K and V whole, attends, and in backward reduce-scatters their gradients. Simple and
not limited by heads; its bytes are the ring's, but nothing overlaps them and every rank holds the
whole sequence's K/V at once.

Taught in notebook 09.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather_seq, head_to_seq, seq_to_head
from .layout import check_shards
from .softmax import attention


def ulysses_attention(q, k, v, pos, group=None, causal: bool = True):
    """Attention of this rank's tokens over the whole sequence, by two all-to-alls.

    ``q``, ``k``, ``v``: (B, H, S/P, D), this rank's tokens in its layout's order; ``pos``:
    every rank's positions (:func:`~.layout.positions`). Returns (B, H, S/P, D).
    """
    check_shards(q, pos, dist.get_rank(group), dist.get_world_size(group), "Ulysses")
    qh, kh, vh = (seq_to_head(t, group) for t in (q, k, v))  # each (B, H/P, S, D)
    whole = torch.cat(pos)  # the positions of the gathered sequence, rank by rank
    out = attention(qh, kh, vh, causal, whole, whole)  # (B, H/P, S, D)
    return head_to_seq(out, group)  # (B, H, S/P, D)


def allgather_attention(q, k, v, pos, group=None, causal: bool = True):
    """Attention of this rank's queries over every rank's K/V, gathered whole (see the module)."""
    check_shards(q, pos, dist.get_rank(group), dist.get_world_size(group), "all-gather attention")
    kw, vw = (all_gather_seq(t, group) for t in (k, v))  # each (P, B, H, s, D)
    kw = kw.permute(1, 2, 0, 3, 4).flatten(2, 3)  # (B, H, S, D), rank by rank
    vw = vw.permute(1, 2, 0, 3, 4).flatten(2, 3)
    return attention(q, kw, vw, causal, pos[dist.get_rank(group)], torch.cat(pos))
