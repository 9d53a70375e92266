"""Context parallelism applied to a single-device model from outside, and its parity worker.

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

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..measure import max_abs_diff, worst
from ..models import GPT, CausalSelfAttention
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


IGNORE = -100  # cross_entropy's ignore_index: a position without a target


def cp_parity_worker(ctx, cfg, method: str, layout: str, steps: int = 3, batch: int = 2, lr=0.1):
    """Train the GPT with context parallelism over every rank for ``steps`` SGD steps and, in the
    same process, a single-device copy on the whole sequences; returns the largest differences
    of the losses and of the parameters (float64). The targets are the next tokens, shifted on the
    whole sequence before it is sharded, and the last position has none: a rank that shifted its
    own shard, or divided by its own token count, would differ from one process."""
    torch.manual_seed(0)
    ref = GPT(cfg).double().to(ctx.device)
    model = copy.deepcopy(ref)
    pos = apply_cp(model, method, layout)
    mine = pos[ctx.rank].to(ctx.device)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    out = {"loss": 0.0, "params": 0.0}
    for _ in range(steps):
        ids = torch.randint(cfg.vocab, (batch, cfg.seq_len), generator=gen).to(ctx.device)
        tgt = ids.roll(-1, 1)  # next-token targets: shifted on the whole sequence, then sharded
        tgt[:, -1] = IGNORE  # the last token has no next one (its rank has one real token less)
        counted = int((tgt != IGNORE).sum())  # the whole batch's real targets
        full = F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten(), ignore_index=IGNORE)
        full.backward()
        logits = model(ids[:, mine], positions=mine)  # (B, S/P, vocab)
        local = F.cross_entropy(logits.flatten(0, 1), tgt[:, mine].flatten(), reduction="sum",
                                ignore_index=IGNORE)  # fmt: skip
        (local / counted).backward()  # this rank's share of the mean over every real target
        for prm in model.parameters():
            dist.all_reduce(prm.grad)  # weights are whole on every rank: sum the shares
        loss = local.detach().clone()
        dist.all_reduce(loss)
        out["loss"] = worst([out["loss"], abs(float(loss) / counted - float(full))])
        opt_ref.step(), opt.step()
        opt_ref.zero_grad(), opt.zero_grad()
    out["params"] = max_abs_diff(zip(model.parameters(), ref.parameters()))  # NaN if any is
    return out
