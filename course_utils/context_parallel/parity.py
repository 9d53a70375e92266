"""Context parallelism trained against one process: :func:`cp_parity_worker` (notebook 09)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..measure import worst
from ..models import GPT
from ..parity import train_beside_reference
from .apply import apply_cp

IGNORE = -100  # cross_entropy's ignore_index: a position without a target


def token_batches(cfg, steps: int, batch: int, device):
    """``steps`` batches ``(ids, tgt)``: random token ids ``(B, S)`` and next-token targets, shifted
    on the whole sequence before any sharding; the last position has none (:data:`IGNORE`)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)
        tgt = ids.roll(-1, 1)  # next-token targets: shifted on the whole sequence, then sharded
        tgt[:, -1] = IGNORE  # the last token has no next one (its rank has one real token less)
        yield ids, tgt


def cp_parity_worker(ctx, cfg, method: str, layout: str, steps: int = 3, batch: int = 2, lr=0.1):
    """Train the GPT with context parallelism over every rank for ``steps`` SGD steps and, in the
    same process, a single-device copy on the whole sequences; returns the largest differences
    of the losses and of the parameters (float64). The targets are the next tokens, shifted on the
    whole sequence before it is sharded, and the last position has none: a rank that shifted its
    own shard, or divided by its own token count, would differ from one process."""
    held = {}

    def parallelize(model):
        held["mine"] = apply_cp(model, method, layout)[ctx.rank].to(ctx.device)
        return model, torch.optim.SGD(model.parameters(), lr=lr)

    def reference_loss(ref, batch):
        ids, tgt = batch
        full = F.cross_entropy(ref(ids).flatten(0, 1), tgt.flatten(), ignore_index=IGNORE)
        full.backward()
        return float(full)

    def shard(batch):  # this rank's positions, and the whole batch's count of real targets
        ids, tgt = batch
        mine = held["mine"]
        return ids[:, mine], tgt[:, mine], mine, int((tgt != IGNORE).sum())

    def train_step(model, opt, part):
        ids, tgt, mine, counted = part
        logits = model(ids, positions=mine)  # (B, S/P, vocab)
        local = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum",
                                ignore_index=IGNORE)  # fmt: skip
        (local / counted).backward()  # this rank's share of the mean over every real target
        for prm in model.parameters():
            dist.all_reduce(prm.grad)  # weights are whole on every rank: sum the shares
        loss = local.detach().clone()
        dist.all_reduce(loss)
        opt.step()
        opt.zero_grad()
        return float(loss) / counted

    run = train_beside_reference(
        lambda: GPT(cfg).double().to(ctx.device),
        parallelize,
        lambda model, ref: zip(model.parameters(), ref.parameters()),
        token_batches(cfg, steps, batch, ctx.device),
        train_step,
        shard=shard,
        reference_loss=reference_loss,
        reference_optimizer=lambda params: torch.optim.SGD(params, lr=lr),
    )
    loss = worst(abs(mine - full) for mine, full in zip(run.outputs, run.reference_losses))
    return {"loss": loss, "params": run.diffs[-1]}  # NaN if any is
