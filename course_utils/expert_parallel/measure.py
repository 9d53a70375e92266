"""Expert parallelism against its formulas: all-to-all volume, parameters total and active.

- :func:`all_to_all_values`: with ``T`` tokens per rank, ``k`` experts per token, hidden ``h`` and
  ``n`` expert-parallel ranks holding equal shares of evenly loaded experts, a fraction ``(n−1)/n``
  of the ``T·k`` assignments go to another rank: the dispatch sends ``T·k·h·(n−1)/n`` values per
  rank, the combine the same back; backward repeats both.
- :class:`~course_utils.comm.AllToAllCounter` counts what an all-to-all really sent.
- :func:`moe_params`: a transformer's parameters with MoE MLPs, total and active per token
  (Mixtral 8×7B: 46.7 B total, 12.9 B active, as Mistral AI publishes).

Taught in notebook 10.
"""

from __future__ import annotations

from ..comm.ledger import ring_factor


def all_to_all_values(tokens: int, k: int, h: int, n: int) -> dict:
    """``{"dispatch": ..., "combine": ...}``: values one rank sends per MoE layer, forward, with
    an even load (backward sends the same again)."""
    one_way = ring_factor("all_to_all", n) * tokens * k * h
    return {"dispatch": one_way, "combine": one_way}


def moe_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, experts: int,
               k: int, vocab: int, tied: bool = False) -> dict:  # fmt: skip
    """``{"total": ..., "active": ...}`` parameters of a decoder whose every MLP is a mixture of
    ``experts`` SwiGLU experts (three ``hidden × ffn`` matrices each), ``k`` active per token, with
    grouped-query attention (``kv_heads``), RMSNorm and no biases (Mixtral's and Llama's layout)."""
    head_dim = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    expert = 3 * hidden * ffn
    router, norms = hidden * experts, 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    per_layer_total = attention + experts * expert + router + norms
    per_layer_active = attention + k * expert + router + norms
    return {
        "total": layers * per_layer_total + embeddings + hidden,
        "active": layers * per_layer_active + embeddings + hidden,
    }
