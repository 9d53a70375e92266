"""Which tokens of a sequence each context-parallel rank holds, and what that costs under a mask.

With a causal mask, query ``i`` sees keys ``0..i``: the late tokens do most of the work. Cut the
sequence into ``n`` contiguous pieces and the last rank computes ``n`` times the first one's
scores when a block cut by the diagonal is computed whole (as here: only pieces the mask hides
entirely are skipped), ``2n − 1`` times with a kernel that also skips the diagonal block's masked
half. The **zig-zag** layout (Megatron-LM's context parallelism and torch's ``context_parallel``, as
its head-tail load balancer, use it) cuts the sequence into ``2n`` chunks and gives rank ``i``
chunks ``i`` and ``2n − 1 − i``: one early, one late, the same work for everyone. (Striped
attention, Brandon et al. 2023, deals the tokens out round-robin instead.)

    >>> [p.tolist() for p in positions("zigzag", 2, 8)]
    [[0, 1, 6, 7], [2, 3, 4, 5]]

Taught in notebook 09.
"""

from __future__ import annotations

import torch

from .softmax import tile_size, visible_pieces

LAYOUTS = ("contiguous", "zigzag")


def check_shards(q: torch.Tensor, pos, rank: int, n: int, method: str) -> None:
    """Refuse, before anything is sent, shards that a context-parallel ``method`` cannot exchange.

    ``pos`` is every rank's positions, the same list on every rank, so every rank reaches the
    same verdict without a message: unequal shards would otherwise make the ranks post receives
    of different sizes (gloo aborts the process, NCCL hangs)."""
    if len(pos) != n:
        raise ValueError(f"{method}: pos holds {len(pos)} ranks' positions, but the group has {n}")
    lengths = [len(p) for p in pos]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"{method} needs the same number of tokens on every rank; the positions give "
            f"{', '.join(map(str, lengths))} tokens to ranks 0..{n - 1}: split the sequence with "
            "positions(layout, n, seq_len), seq_len a multiple of n (2n for zig-zag)"
        )
    if lengths[rank] != q.shape[-2]:
        raise ValueError(
            f"{method}: rank {rank} holds {q.shape[-2]} tokens, but its positions list "
            f"{lengths[rank]}"
        )


def positions(layout: str, n: int, seq_len: int) -> list[torch.Tensor]:
    """The token positions each of ``n`` ranks holds, in the order it holds them.

    ``"contiguous"``: rank ``i`` holds ``i·S/n .. (i+1)·S/n − 1`` (``seq_len`` a multiple of
    ``n``). ``"zigzag"``: chunks ``i`` and ``2n−1−i`` of ``2n`` (``seq_len`` a multiple of ``2n``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pieces = n if layout == "contiguous" else 2 * n
    if n < 1 or seq_len % pieces:
        raise ValueError(
            f"the {layout} layout cuts the sequence into {pieces} equal chunks for {n} ranks, but "
            f"seq_len={seq_len} is not a multiple of {pieces}: pad the sequence to a multiple"
        )
    c = seq_len // pieces
    chunks = torch.arange(seq_len).view(pieces, c)
    if layout == "contiguous":
        return [chunks[i] for i in range(n)]
    return [torch.cat([chunks[i], chunks[pieces - 1 - i]]) for i in range(n)]


def shard(x: torch.Tensor, pos: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (the whole sequence along ``dim``), in ``pos`` order."""
    return x.index_select(dim, pos.to(x.device))


def unshard(parts: list[torch.Tensor], pos: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every rank's part (the inverse of :func:`shard`)."""
    order = torch.cat(pos).argsort()
    return torch.cat(parts, dim).index_select(dim, order.to(parts[0].device))


def work_per_rank(
    layout: str, n: int, seq_len: int, causal: bool = True, tile: int | None = None
) -> list[int]:
    """Query-key scores each rank computes in ring attention over the whole ring (pieces a causal
    mask hides entirely skipped): the load that sets each rank's time. ``tile``: the granularity
    at which the mask is applied (default: the layout's own, :func:`~.softmax.tile_size`); give
    two layouts the same tile to compare them on the same kernel."""
    pos = positions(layout, n, seq_len)
    tile = tile or tile_size(pos)
    return [
        sum(
            (qb - qa) * (kb - ka)
            for k in pos  # every rank's keys pass by once
            for (qa, qb), (ka, kb), _ in visible_pieces(q, k, causal, tile)
        )
        for q in pos
    ]
