"""Context parallelism applied to a single-device model from outside (parity worker: :mod:`.parity`).

:func:`apply_cp` replaces the ``attend`` method of every
:class:`~course_utils.models.CausalSelfAttention` in the model (on the instances; the class is
untouched) with ring, Ulysses or all-gather attention over the context-parallel group, and returns
every rank's token positions. Each rank then feeds the model its shard of the tokens with their
positions; everything outside attention works token by token and needs nothing else. The
weights stay whole on every rank, so their gradients are summed over the group, as data
parallelism does (Megatron-LM reduces them over its data × context parallel group).

    pos = apply_cp(model, "ring", "zigzag")          # inside a rank
    mine = pos[dist.get_rank()]
    logits = model(ids[:, mine], positions=mine)     # (B, S/P, vocab)

Taught in notebook 09.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..models import CausalSelfAttention
from .layout import positions
from .ring import ring_attention
from .ulysses import allgather_attention, ulysses_attention

METHODS = {"ring": ring_attention, "ulysses": ulysses_attention, "allgather": allgather_attention}


def apply_cp(
    model: nn.Module, method: str = "ring", layout: str = "zigzag", group=None, seq_len=None
):
    """Make every attention of ``model`` context-parallel over ``group``; returns the positions
    each rank holds (:func:`~.layout.positions`), the same list on every rank.

    ``seq_len``: the whole sequence's length (default: the model's ``cfg.seq_len``). Refuses
    attention dropout (its masks would have to be drawn per shard) and, for Ulysses, a head count
    the group's size does not divide.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    seq_len = seq_len or model.cfg.seq_len
    n = dist.get_world_size(group)
    pos = positions(layout, n, seq_len)
    found = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not found:
        raise ValueError("apply_cp found no CausalSelfAttention in the model")
    for attn in found:
        if not isinstance(attn.attn_drop, nn.Identity):
            raise ValueError(
                "apply_cp: attention dropout is on; context-parallel attention here has none "
                "(build the model with dropout=0.0)"
            )
        if method == "ulysses" and attn.n_heads % n:
            raise ValueError(
                f"Ulysses gives each of {n} ranks whole heads, but the model has "
                f"{attn.n_heads} heads: pick a degree dividing {attn.n_heads}, or ring attention"
            )
        fn = METHODS[method]
        attn.attend = lambda q, k, v, fn=fn: fn(q, k, v, pos, group, True)
    return pos
