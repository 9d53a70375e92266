"""Top-k routing for a mixture of experts, with capacity and the load-balancing loss.

For ``T`` tokens and ``E`` experts the router's logits ``(T, E)`` become probabilities by a
softmax; each token goes to its ``k`` most probable experts, weighted by those probabilities
(renormalised over the ``k`` when ``k > 1``, as Mixtral does; for ``k = 1`` the probability itself,
as the Switch Transformer does, so that the router still gets a gradient from the loss).

**Capacity** (GShard, Switch): an expert takes at most ``C = ⌈capacity_factor · T·k / E⌉``
tokens of a batch; assignments beyond are **dropped** (the token keeps only its residual path).
Places are given in order: every token's first choice, in token order, then every second choice,
and so on. ``capacity_factor=None``: no limit (dropless, as Megatron-Core and MegaBlocks can run).

**Load-balancing loss** (Switch Transformer, eq. 4; Megatron-Core's ``switch_load_balancing``):
``aux = E · Σ_i f_i · P_i``, with ``f_i`` the fraction of the ``T·k`` assignments routed to expert
``i`` (before dropping) and ``P_i`` the mean probability the router gives it. Only ``P`` carries a
gradient, ``E·f_i`` for expert ``i``: descending it moves probability away from the busiest experts.
Its value is not a measure of imbalance: it is 1 when load and probabilities are even, at least 1
when the probabilities follow the load, and can fall below 1 when they do not (k = 1, a 70/30 load
whose mean probabilities are 0.4/0.6: 2·(0.7·0.4 + 0.3·0.6) = 0.92).

Single-device (no ``torch.distributed``): the expert-parallel layer routes each rank's tokens with
it. Taught in notebook 10.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """Where each of ``T`` tokens goes."""

    experts: torch.Tensor
    """(T, k) long: the chosen experts, most probable first."""
    weights: torch.Tensor
    """(T, k): each choice's weight in the token's output."""
    keep: torch.Tensor
    """(T, k) bool: False where the expert was full (the assignment is dropped)."""
    aux_loss: torch.Tensor
    """Scalar: the load-balancing loss ``E · Σ f_i P_i`` (1 when even)."""
    counts: torch.Tensor
    """(E,) long: assignments each expert takes (after dropping)."""
    capacity: int | None
    """Places per expert, ``None`` without a limit."""


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float | None) -> int | None:
    """``⌈capacity_factor · tokens·k / E⌉`` places per expert (None: no limit).

    Rounded up as exact arithmetic would: ``1.1 · 50 / 5`` is 11, though in floating point it
    comes out 11.000000000000002, whose plain ``ceil`` is 12."""
    if capacity_factor is None:
        return None
    share = capacity_factor * tokens * k / n_experts
    return math.ceil(share - 1e-9 * max(1.0, share))  # a rounding error is not a fraction


def route(logits: torch.Tensor, k: int, capacity_factor: float | None = None,
          normalize: bool | None = None) -> Routing:  # fmt: skip
    """Route ``T`` tokens by their ``logits`` (T, E) to ``k`` experts each (see the module)."""
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"top-k routing needs 1 <= k <= E={E} experts, got k={k}")
    normalize = k > 1 if normalize is None else normalize
    probs = torch.softmax(logits, dim=-1)  # (T, E)
    top, experts = probs.topk(k, dim=-1)  # (T, k) each
    weights = top / top.sum(-1, keepdim=True) if normalize else top
    cap = capacity(T, E, k, capacity_factor)
    order = experts.t().reshape(-1)  # choice-major: every first choice, then every second...
    onehot = torch.nn.functional.one_hot(order, E)  # (k*T, E)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each assignment's place in its expert
    keep = torch.ones_like(order, dtype=torch.bool) if cap is None else place < cap
    keep = keep.view(k, T).t()  # (T, k)
    routed = torch.bincount(experts.reshape(-1), minlength=E)  # before dropping
    if T == 0:  # a rank with no tokens has no load to balance: a zero that keeps the graph
        aux = logits.sum() * 0.0
    else:
        f = routed.to(probs.dtype) / (T * k)  # (E,)
        aux = E * (f * probs.mean(0)).sum()
    counts = torch.bincount(experts[keep], minlength=E)
    return Routing(experts, weights, keep, aux, counts, cap)
