"""Equivalence with one process: the check every data-parallel implementation must pass.

Each rank trains two models from the same seed: the parallel one on its shard of the global
batch, and a single-process reference on the *whole* global batch (every rank computes it
redundantly, so no extra process is needed). After every optimizer step the largest parameter
difference is recorded. Mean-reduced losses and gradients averaged over equal shards make the
two mathematically identical. Only the order of floating-point summation differs, so float64
agrees to ~1e-12. The loop itself is :func:`course_utils.parity.train_beside_reference`, shared by
every technique's check.

Ranks that do not behave alike (``rank_dependent=True``: the model's forward reads
``model.rank``) have a different reference: the mean over ranks of each rank's gradient on its
own shard, a missing gradient counting as zero. That is what torch DDP computes with
``find_unused_parameters=True``; the reference replays every rank's behaviour in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..measure import max_abs_diff
from ..parity import global_batches, train_beside_reference, whole_batch_loss


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between corresponding parameters (NaN if any is NaN)."""
    return max_abs_diff(zip(a.parameters(), b.parameters()))


def parity_worker(
    ctx,
    make_model: Callable[[], nn.Module],
    wrap: Callable[[nn.Module], nn.Module],
    steps: int = 3,
    global_batch: int = 16,
    in_features: int = 16,
    classes: int = 4,
    lr: float = 0.1,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    accumulate: int = 1,
    rank_dependent: bool = False,
    optimizer: str = "sgd",
) -> list[float]:
    """Run under ``launch``: max |param difference| to single-process training after each step.

    ``accumulate > 1`` splits every step into micro-batches (``chunk``: uneven when the shard does
    not divide), each loss weighted by its share of the shard's samples, syncing only on the last
    one (``no_sync``), against the reference's single backward on the whole global batch.
    ``rank_dependent``: see the module docstring. ``optimizer``: ``"sgd"`` or ``"adam"``.
    """
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    make_opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]

    def parallelize(copy):
        model = wrap(copy)
        if rank_dependent:
            getattr(model, "module", model).rank = r
        return model, make_opt(model.parameters(), lr=lr)

    def reference_loss(reference, batch):
        x, y = batch
        if not rank_dependent:
            return whole_batch_loss(reference, batch)
        for q in range(n):  # every rank's behaviour on its own shard, gradients averaged
            reference.rank = q
            loss = nn.functional.cross_entropy(reference(x.chunk(n)[q]), y.chunk(n)[q])
            (loss / n).backward()
        return float("nan")  # no single loss: each rank's shard has its own

    def train_step(model, opt, shard):
        xs, ys = shard  # this rank's shard: (global_batch / n, in_features)
        opt.zero_grad()
        micro = list(zip(xs.chunk(accumulate), ys.chunk(accumulate)))
        for i, (xm, ym) in enumerate(micro):
            sync = i == len(micro) - 1
            ctx_mgr = (
                model.no_sync()
                if not sync and hasattr(model, "no_sync")
                else contextlib.nullcontext()
            )
            with ctx_mgr:
                # weighted by its share of the shard's samples: right for uneven micro-batches
                (nn.functional.cross_entropy(model(xm), ym) * len(xm) / len(xs)).backward()
        getattr(model, "finish_gradient_synchronization", lambda: None)()
        opt.step()

    run = train_beside_reference(
        lambda: make_model().to(ctx.device, dtype),
        parallelize,
        lambda model, reference: zip(
            reference.parameters(), getattr(model, "module", model).parameters()
        ),
        global_batches(steps, global_batch, in_features, classes, dtype, ctx.device, seed + 1),
        train_step,
        shard=lambda batch: tuple(t.chunk(n)[r] for t in batch),
        reference_loss=reference_loss,
        reference_optimizer=lambda params: make_opt(params, lr=lr),
        seed=seed,
    )
    return run.diffs
