"""Context parallelism against its formulas: the values each rank sends per attention layer.

For ``P`` ranks, a micro-batch of ``b`` sequences of ``S`` tokens, hidden size ``h`` (queries and
outputs) and ``h_kv`` (keys and values; ``h`` without grouped-query attention):

=================  ====================================  ====================================
method             forward                               backward
=================  ====================================  ====================================
ring               K, V: ``2·b·(S/P)·h_kv·(P−1)``        K, V again ``(P−1)`` hops, dK, dV
                   (``P−1`` hops of this rank's block)   ``P`` hops: ``2·b·(S/P)·h_kv·(2P−1)``
all-gather K/V     the same as ring, in one all-gather   dK, dV reduce-scattered: as forward
Ulysses            4 all-to-alls (Q, K, V, out), each    the same four, reversed
                   ``(P−1)/P`` of ``b·(S/P)·h``:
                   ``b·(S/P)·(2h + 2h_kv)·(P−1)/P``
=================  ====================================  ====================================

Ring and all-gather send about ``2·b·S·h_kv`` per rank whatever ``P``; Ulysses sends ``4·b·S·h/P``
(the paper's ``4Nh/P``), so it falls as ``P`` grows. Taught in notebook 09.
"""

from __future__ import annotations

METHODS = ("ring", "allgather", "ulysses")


def values_per_rank(method: str, b: int, seq_len: int, h: int, p: int, h_kv: int | None = None):
    """``{"forward": ..., "backward": ...}``: values one rank sends per attention layer."""
    h_kv = h if h_kv is None else h_kv
    s = b * seq_len // p  # tokens per rank
    if p == 1:
        return {"forward": 0.0, "backward": 0.0}
    if method == "ring":
        return {"forward": 2.0 * s * h_kv * (p - 1), "backward": 2.0 * s * h_kv * (2 * p - 1)}
    if method == "allgather":
        kv = 2.0 * s * h_kv * (p - 1)
        return {"forward": kv, "backward": kv}
    if method == "ulysses":
        a2a = s * (2 * h + 2 * h_kv) * (p - 1) / p
        return {"forward": a2a, "backward": a2a}
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
