"""Attention in blocks: the online softmax that lets attention run on one block of keys at a time.

Softmax attention over keys ``1..S`` is, for one query row, ``Σ_j exp(s_j − L) v_j`` with
``L = log Σ_j exp(s_j)`` (the log-sum-exp, LSE). Split the keys into blocks A and B: each block
gives its own normalised output ``o_A`` (with ``L_A``) and ``o_B`` (with ``L_B``), and the whole is

    L = log(exp(L_A) + exp(L_B))            (torch.logaddexp: no overflow)
    o = exp(L_A − L) · o_A + exp(L_B − L) · o_B

so no block ever needs the others' scores (Milakov and Gimelshein 2018, "Online normalizer
calculation for softmax"; FlashAttention does this inside a GPU, ring attention across GPUs). A
row that sees no key at all in a block (causal masking) has ``L = −inf`` and ``o = 0`` there, and
the merge must keep it so instead of producing ``nan``.

:func:`block_attention` is one block, :func:`merge` the step above, :func:`causal_block_attention`
one block of queries against one block of keys at given positions, skipping the pieces the causal
mask hides. Taught in notebook 09.
"""

from __future__ import annotations

import torch


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``−inf`` replaced by 0, to subtract safely (rows that see nothing)."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_attention(q, k, v, mask=None, scale=None):
    """Softmax attention of ``q`` over one block of keys, and the block's log-sum-exp.

    ``q`` (B, H, Sq, D), ``k`` and ``v`` (B, H, Sk, D); ``mask`` (Sq, Sk) boolean, True where a
    query may see a key (None: every key). Returns ``out`` (B, H, Sq, D), normalised within the
    block, and ``lse`` (B, H, Sq): ``−inf`` (and ``out`` 0) for a row that sees no key.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))  # rows that see nothing: all 0
    return probs @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    """Two blocks' results for the same queries, merged into the result over both blocks' keys.

    ``out_*`` (..., Sq, D), ``lse_*`` (..., Sq). Equal to attention over the union of the keys;
    rows that saw no key in either block stay ``lse = −inf``, ``out = 0``.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # (..., Sq)
    base = _finite(lse)
    wa, wb = torch.exp(lse_a - base), torch.exp(lse_b - base)  # each row's weights, sum to 1
    return wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b, lse


def runs(positions: torch.Tensor, tile: int | None = None) -> list[tuple[int, int]]:
    """The contiguous runs of a rank's token positions, as ``(start, end)`` index ranges into
    ``positions`` (a zig-zag shard has two runs, a contiguous one one), each cut into tiles of at
    most ``tile`` tokens when it is given."""
    pos = positions.tolist()
    out, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1 or (tile and i - start == tile):
            out.append((start, i))
            start = i
    return out


def tile_size(pos: list[torch.Tensor]) -> int:
    """The shortest run over every rank's positions: the tile the causal mask is applied at
    (a zig-zag rank whose two chunks happen to touch is still cut at the chunks' border)."""
    return min(b - a for p in pos for a, b in runs(p))


def visible_pieces(q_pos, k_pos, causal: bool, tile: int | None = None):
    """Which pieces of a (queries × keys) block a causal mask leaves anything in.

    Returns the list of ``(q_run, k_run, mask)`` to compute, over runs (or tiles of ``tile``
    tokens) of the query and key positions: a pair wholly visible has ``mask=None``, one cut by
    the diagonal a boolean mask, and a pair the mask hides entirely is left out (its work is
    skipped, as FlashAttention and ring attention skip it).
    """
    pieces = []
    for qa, qb in runs(q_pos, tile):
        for ka, kb in runs(k_pos, tile):
            qp, kp = q_pos[qa:qb], k_pos[ka:kb]
            if not causal or int(qp[0]) >= int(kp[-1]):
                pieces.append(((qa, qb), (ka, kb), None))  # every key at or before every query
            elif int(qp[-1]) >= int(kp[0]):
                pieces.append(((qa, qb), (ka, kb), qp[:, None] >= kp[None, :]))
    return pieces


def causal_block_attention(q, k, v, q_pos, k_pos, causal: bool = True, scale=None, tile=None):
    """``q`` at positions ``q_pos`` against ``k``/``v`` at ``k_pos``: ``(out, lse, work)``.

    ``work`` counts the query-key scores computed (pieces the causal mask hides entirely are
    skipped), the unit in which ring attention's load per rank is measured.
    """
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    work = 0
    for (qa, qb), (ka, kb), mask in visible_pieces(q_pos, k_pos, causal, tile):
        if mask is not None:
            mask = mask.to(q.device)
        o, s = block_attention(q[..., qa:qb, :], k[..., ka:kb, :], v[..., ka:kb, :], mask, scale)
        out[..., qa:qb, :], lse[..., qa:qb] = merge(out[..., qa:qb, :], lse[..., qa:qb], o, s)
        work += (qb - qa) * (kb - ka)
    return out, lse, work


def attention(q, k, v, causal: bool = True, q_pos=None, k_pos=None):
    """Plain softmax attention on one device (the reference everything here is checked against):
    ``q`` (B, H, Sq, D), ``k``/``v`` (B, H, Sk, D); positions default to ``0..S−1``."""
    q_pos = torch.arange(q.shape[-2]) if q_pos is None else q_pos
    k_pos = torch.arange(k.shape[-2]) if k_pos is None else k_pos
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, Sq, Sk)
    if causal:
        visible = (q_pos[:, None] >= k_pos[None, :]).to(q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
