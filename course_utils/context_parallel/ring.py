"""Ring attention (Liu et al. 2023): attention over a sequence sharded across ranks.

Each of ``n`` ranks holds the queries, keys and values of its own tokens. In ``n`` steps, every
rank's K/V block visits every rank once, passed around the ring; each rank attends its queries to
the block it holds and merges the result into its running output with the online softmax
(:func:`~.softmax.merge`), so the result equals full attention while no rank ever holds more than
two K/V blocks.

What travels (each rank, forward): its K and V, ``n − 1`` hops, ``2·b·(S/n)·h_kv`` values each,
sent while the current block is computed. Backward: K and V pass around again (``n − 1`` hops),
and with them the gradients ``dK``, ``dV`` each rank adds to on the way, which take one more hop
to come home (``n`` hops). With a causal mask, pieces of a block that the mask hides are skipped:
the zig-zag layout (:mod:`.layout`) gives every rank the same work.

    out = ring_attention(q, k, v, positions("zigzag", n, S), group=None, causal=True)

``q``, ``k``, ``v`` are this rank's (B, H, S/n, D) tokens in its layout's order. Taught in
notebook 09.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import Ring
from .layout import check_shards
from .softmax import _finite, causal_block_attention, merge, tile_size, visible_pieces


class RingAttention(torch.autograd.Function):
    """Forward: K/V around the ring, blocks merged by log-sum-exp. Backward: K/V around again,
    with the ``dK``/``dV`` accumulators, which end on their owners."""

    @staticmethod
    def forward(ctx, q, k, v, pos, group, causal):
        ring = Ring(group)
        n, r = ring.n, ring.rank
        out = torch.zeros_like(q)  # (B, H, s, D)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        k_cur, v_cur, tile = k, v, tile_size(pos)
        for step in range(n):
            src = (r - step) % n  # whose K/V this rank holds now
            nxt = ring.start(k_cur, v_cur) if step < n - 1 else None  # overlaps the compute
            o, s, _ = causal_block_attention(q, k_cur, v_cur, pos[r], pos[src], causal, tile=tile)
            out, lse = merge(out, lse, o, s)
            if nxt is not None:
                ring.wait()
                k_cur, v_cur = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pos, ctx.group, ctx.causal = pos, group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        n, r, pos = ring.n, ring.rank, ctx.pos
        scale = q.shape[-1] ** -0.5
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # (B, H, s): softmax's backward term, one per query
        dq = torch.zeros_like(q)
        k_cur, v_cur = k, v
        dk_cur, dv_cur = torch.zeros_like(k), torch.zeros_like(v)  # travel with their K/V
        base, tile = _finite(lse).unsqueeze(-1), tile_size(pos)
        for step in range(n):
            src = (r - step) % n
            nxt = ring.start(k_cur, v_cur) if step < n - 1 else None
            for (qa, qb), (ka, kb), mask in visible_pieces(pos[r], pos[src], ctx.causal, tile):
                qs, ks, vs = q[..., qa:qb, :], k_cur[..., ka:kb, :], v_cur[..., ka:kb, :]
                scores = (qs @ ks.transpose(-2, -1)) * scale  # (B, H, sq, sk)
                if mask is not None:
                    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
                p = torch.exp(scores - base[..., qa:qb, :])  # the forward's probabilities
                do = dout[..., qa:qb, :]
                dv_cur[..., ka:kb, :] += p.transpose(-2, -1) @ do
                ds = p * (do @ vs.transpose(-2, -1) - delta[..., qa:qb, None])
                dq[..., qa:qb, :] += (ds @ ks) * scale
                dk_cur[..., ka:kb, :] += (ds.transpose(-2, -1) @ qs) * scale
            if nxt is not None:
                ring.wait()
                k_cur, v_cur = nxt
            dk_cur, dv_cur = ring.start(dk_cur, dv_cur)  # on to the next owner's way home
            ring.wait()
        return dq, dk_cur, dv_cur, None, None, None


def ring_attention(q, k, v, pos, group=None, causal: bool = True):
    """Attention of this rank's queries over the whole sharded sequence (see the module).

    ``pos``: every rank's token positions (:func:`~.layout.positions`), the same list on all.
    """
    check_shards(q, pos, dist.get_rank(group), dist.get_world_size(group), "ring attention")
    return RingAttention.apply(q, k, v, pos, group, causal)
