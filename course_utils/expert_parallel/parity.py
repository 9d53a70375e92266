"""Expert parallelism (with data parallelism) trained against one process, in float64.

:func:`ep_parity_worker` trains :class:`~.layer.MoENet` on ``ep × edp`` ranks, each with its own
batch: the experts spread over each EP group, the copies of an expert over the EDP group, the
dense layers everywhere. In the same process a single-device copy computes the mean of every
rank's loss (each rank's tokens routed on their own, as expert parallelism routes them) and takes
the same SGD steps. Ranks see different data, so experts get uneven token counts, and some none.

Taught in notebook 10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..measure import worst
from ..parallel3d.dims import ParallelDims
from ..parity import train_beside_reference
from .apply import apply_ep, sync_gradients
from .layer import MoEConfig, MoENet


def rank_batch(cfg: MoEConfig, rank: int, step: int, tokens: int, device, skew: float = 0.0):
    """Rank ``rank``'s batch at ``step``: inputs (tokens, h) and labels; ``skew`` shifts the inputs
    along one direction so that the router favours some experts (imbalance on purpose)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(tokens, cfg.d_model, generator=g, dtype=torch.float64)
    x[:, 0] += skew
    y = torch.randint(cfg.classes, (tokens,), generator=g)
    return x.to(device), y.to(device)


def ep_parity_worker(ctx, cfg: MoEConfig, ep: int, tokens: int = 12, steps: int = 3, lr=0.1):
    """Train with EP = ``ep`` (and EDP = world/ep) and, alongside, one process; returns the largest
    differences of the losses and parameters, the rows each local expert ran on, and the
    assignments this rank dropped."""
    dims = ParallelDims(dp=ctx.world_size, pp=1, tp=1, ep=ep)
    groups = dims.build() if ep > 1 else None
    ep_group = groups.group("ep") if ep > 1 else None
    edp_group = groups.group("edp") if ep > 1 and dims.degree("edp") > 1 else None
    if ep == 1:  # no expert parallelism: every rank holds every expert, a plain DP copy
        edp_group = dist.group.WORLD

    def parallelize(model):
        if ep > 1:
            apply_ep(model.moe, ep_group)
        return model, torch.optim.SGD(model.parameters(), lr=lr)

    def reference_loss(ref, step):  # the mean of every rank's loss on its own batch
        batches = [rank_batch(cfg, r, step, tokens + r, ctx.device) for r in range(ctx.world_size)]
        ref_loss = sum(ref.loss(*b) for b in batches) / ctx.world_size
        ref_loss.backward()
        return float(ref_loss)

    def train_step(model, opt, step):
        x, y = rank_batch(cfg, ctx.rank, step, tokens + ctx.rank, ctx.device)  # uneven batches
        loss = model.loss(x, y)
        loss.backward()
        sync_gradients(model, None, edp_group, ctx.world_size)
        rows = model.moe.stats.get("expert_rows") if ep > 1 else None
        dropped = int((~model.moe.routing.keep).sum())
        total = loss.detach().clone()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        return float(total) / ctx.world_size, rows, dropped

    run = train_beside_reference(
        lambda: MoENet(cfg).double().to(ctx.device),
        parallelize,
        lambda model, ref: local_experts(model, ref, cfg),
        range(steps),  # a step's batches come from rank_batch: every rank's, seeded by the step
        train_step,
        reference_loss=reference_loss,
        reference_optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        reference_first=False,
    )
    return {
        "loss": worst(abs(o[0] - ref) for o, ref in zip(run.outputs, run.reference_losses)),
        "params": run.diffs[-1],
        "expert_rows": [o[1] for o in run.outputs],
        "dropped": sum(o[2] for o in run.outputs),
    }


def local_experts(model, ref, cfg: MoEConfig):
    """``(parameter, reference parameter)`` pairs: the dense layers, and the experts this rank holds
    (``experts.{local}`` here is ``experts.{global id}`` in the reference)."""
    mine = dict(model.named_parameters())
    ids = list(getattr(model.moe, "expert_ids", range(cfg.n_experts)))
    for name, p in ref.named_parameters():
        if ".experts." in name:
            idx = int(name.split(".experts.")[1].split(".")[0])
            if idx not in ids:
                continue
            name = name.replace(f".experts.{idx}.", f".experts.{ids.index(idx)}.")
        yield mine[name], p
