"""A mixture-of-experts layer on one device, and a small network around it.

:class:`MoE` replaces a transformer's MLP: a linear **router** scores each token against ``E``
experts, :func:`~.router.route` picks ``k`` of them, and the token's output is the weighted sum
of those experts' outputs (each expert an MLP of its own). Total parameters grow with ``E``; the
work per token only with ``k`` (its *active* parameters). :class:`MoENet` puts a dense layer before
it and a head after, so that a run has dense and expert parameters (the two kinds expert
parallelism treats differently).

Single-device, no ``torch.distributed``: :func:`~.apply.apply_ep` spreads the experts over ranks
from outside. Taught in notebook 10.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .router import Routing, route


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of :class:`MoE` and :class:`MoENet`."""

    d_model: int = 16
    """Hidden size ``h`` of a token."""
    n_experts: int = 4
    """Experts ``E``."""
    top_k: int = 2
    """Experts per token ``k``."""
    ffn_mult: int = 2
    """An expert's MLP width as a multiple of ``d_model``."""
    capacity_factor: float | None = None
    """Places per expert as a multiple of an even share (None: no limit, nothing dropped)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in the training loss (Switch: 0.01)."""
    classes: int = 4
    """Outputs of :class:`MoENet`'s head."""

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"MoEConfig: top_k={self.top_k} must be between 1 and n_experts={self.n_experts}"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"MoEConfig: capacity_factor must be > 0, got {self.capacity_factor}")


class Expert(nn.Module):
    """One expert: ``up`` (h -> ffn), GELU, ``down`` (ffn -> h)."""

    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.up, self.down = nn.Linear(d_model, ffn), nn.Linear(ffn, d_model)

    def forward(self, x):  # (N, h) -> (N, h)
        return self.down(nn.functional.gelu(self.up(x)))


class MoE(nn.Module):
    """Router + ``E`` experts; ``(..., h) -> (..., h)``. After a forward, ``aux_loss`` holds the
    load-balancing loss and ``routing`` the :class:`~.router.Routing` of the tokens it saw."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(cfg.d_model, cfg.ffn_mult * cfg.d_model) for _ in range(cfg.n_experts)
        )
        self.aux_loss: torch.Tensor | None = None
        self.routing: Routing | None = None

    def route(self, x2):  # (T, h) -> Routing
        r = route(self.router(x2), self.cfg.top_k, self.cfg.capacity_factor)
        self.aux_loss, self.routing = r.aux_loss, r
        return r

    def forward(self, x):  # (..., h) -> (..., h)
        x2 = x.reshape(-1, x.shape[-1])  # (T, h)
        r = self.route(x2)
        y = torch.zeros_like(x2)
        for e, expert in enumerate(self.experts):
            t, j = torch.nonzero((r.experts == e) & r.keep, as_tuple=True)  # its tokens
            if len(t):
                y = y.index_add(0, t, r.weights[t, j, None] * expert(x2[t]))
        return y.view_as(x)


class MoENet(nn.Module):
    """``dense`` (h -> h) and a residual :class:`MoE`, then a ``head``: ``(N, h) -> (N, classes)``."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.moe = MoE(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.classes)

    def forward(self, x):  # (N, h) -> (N, classes)
        h = torch.tanh(self.dense(x))
        return self.head(h + self.moe(h))

    def loss(self, x, y):
        """Cross-entropy plus ``aux_loss_coef`` times the load-balancing loss. The mean over
        tokens is a sum divided by their count, so that a rank given no tokens adds a zero
        (``cross_entropy``'s own mean of nothing is NaN)."""
        out = nn.functional.cross_entropy(self(x), y, reduction="sum") / max(len(y), 1)
        return out + self.moe.cfg.aux_loss_coef * self.moe.aux_loss
