"""Checks for notebook 03b (DDP in practice): SyncBatchNorm's statistics, and ranks that stop
together when their data runs out unevenly."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..models import ToyMLP
from .common import ExerciseError, RefuseTorch, fail, launch_check, passed

GATHERING = (
    "your function gathered the ranks' data (all_gather): SyncBatchNorm sends statistics, not "
    "samples: a few numbers per channel and rank, whatever the batch"
)
BUILT_IN = "write the statistics yourself: torch's batch_norm_* functions are SyncBatchNorm's"


@contextlib.contextmanager
def _no_gathering():
    saved = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor",
                                                    "all_gather_object", "gather")}  # fmt: skip

    def refuse(*args, **kwargs):
        fail("03b.1", GATHERING)

    for name in saved:
        setattr(dist, name, refuse)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)


def _stats_worker(ctx, sync_batch_stats, shapes):
    n, r = ctx.world_size, ctx.rank
    refused_ops = [getattr(torch, f) for f in ("batch_norm_stats", "batch_norm_gather_stats",
                   "batch_norm_gather_stats_with_counts", "batch_norm_elemt") if hasattr(torch, f)]  # fmt: skip
    for shape in shapes:  # shape[0] is this rank's batch: it differs from rank to rank
        batches = []
        for q in range(n):
            g = torch.Generator().manual_seed(100 * q + len(shape))
            rows = shape[0] + 3 * q
            batches.append(torch.randn(rows, *shape[1:], generator=g, dtype=torch.float64) + q)
        x = batches[r].to(ctx.device)
        with _no_gathering(), RefuseTorch("03b.1", BUILT_IN, funcs=refused_ops):
            got = sync_batch_stats(x)
        if not (isinstance(got, tuple) and len(got) == 2):
            fail("03b.1", "return (mean, var), one value per channel each")
        mean, var = (t.detach().cpu() for t in got)
        whole = torch.cat(batches)  # one process sees every rank's batch
        dims = [0, *range(2, whole.dim())]  # every dimension but the channels
        want_mean, want_var = whole.mean(dims), whole.var(dims, unbiased=False)
        where = f"on {n} ranks with batches of {[b.shape[0] for b in batches]}, shape {tuple(x.shape)}"
        if tuple(mean.shape) != tuple(want_mean.shape) or tuple(var.shape) != tuple(want_var.shape):
            fail("03b.1", f"{where}: mean and var must have one value per channel, shape "
                 f"{tuple(want_mean.shape)}")  # fmt: skip
        if not torch.allclose(mean, want_mean, rtol=1e-10, atol=1e-12):
            equal_weights = torch.stack([b.mean(dims) for b in batches]).mean(0)
            if torch.allclose(mean, equal_weights, rtol=1e-10, atol=1e-12):
                hint = (
                    "the mean of the ranks' means weighs every rank alike, but their batches "
                    "differ in size: sum the samples and count them, then divide"
                )
            else:
                hint = "the global mean is the sum of every rank's samples over their number"
            fail("03b.1", f"{where}: your mean is wrong: {hint}.")
        if not torch.allclose(var, want_var, rtol=1e-9, atol=1e-12):
            count = whole.numel() // whole.shape[1]
            if torch.allclose(var, want_var * count / (count - 1), rtol=1e-9, atol=1e-12):
                hint = "BatchNorm normalises with the biased variance (divide by N, not N - 1)"
            else:
                hint = (
                    "the variance of the union is not the mean of the ranks' variances: all-reduce "
                    "the sums of squares too, and use E[x²] − E[x]²"
                )
            fail("03b.1", f"{where}: your variance is wrong: {hint}.")
    return True


def check_sync_batch_stats(sync_batch_stats) -> None:
    """Exercise 03b.1: ``sync_batch_stats(x)``: the mean and (biased) variance per channel over every
    rank's batch, as SyncBatchNorm normalises with, from statistics all-reduced across ranks."""
    shapes = [(4, 3), (2, 5, 6), (1, 2, 3, 3)]  # (N, C), (N, C, L), (N, C, H, W)
    for n in (2, 3):
        launch_check("03b.1", _stats_worker, n, sync_batch_stats=sync_batch_stats,
                     shapes=shapes, timeout=90)  # fmt: skip
    passed("03b.1", "the global mean and variance on 2 and 3 ranks with batches of different "
           "sizes, for (N, C), (N, C, L) and (N, C, H, W) inputs, without gathering the data")  # fmt: skip


@contextlib.contextmanager
def _no_join():
    from torch.distributed.algorithms import join

    saved = join.Join.__init__

    def refuse(*args, **kwargs):
        fail("03b.2", "write the agreement yourself: torch's Join is what this exercise rebuilds")

    join.Join.__init__ = refuse
    try:
        yield
    finally:
        join.Join.__init__ = saved


def _uneven_worker(ctx, train_while_all_have_data, lengths):
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    reference = ToyMLP().double().to(ctx.device)
    torch.manual_seed(0)
    model = DDP(ToyMLP().double().to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = []
    for q in range(n):
        g = torch.Generator().manual_seed(q)
        data.append([(torch.randn(4, 16, generator=g, dtype=torch.float64),
                      torch.randint(4, (4,), generator=g)) for _ in range(lengths[q])])  # fmt: skip
    mine = [(x.to(ctx.device), y.to(ctx.device)) for x, y in data[r]]
    with _no_join():
        steps = train_while_all_have_data(model, opt, iter(mine))
    common = min(lengths)
    if steps != common:
        fail("03b.2", f"rank {r} took {steps} steps with {lengths[r]} batches, the ranks having "
             f"{lengths}: every rank must stop after {common}, when the first one runs out")  # fmt: skip
    for s in range(common):  # one process: the same steps on every rank's batches, averaged
        opt_ref.zero_grad()
        for q in range(n):
            x, y = data[q][s]
            (nn.functional.cross_entropy(reference(x.to(ctx.device)), y.to(ctx.device)) / n).backward()
        opt_ref.step()
    diff = max((p - q).abs().max().item() for p, q in zip(model.module.parameters(),
                                                          reference.parameters()))  # fmt: skip
    if diff > 1e-12:
        fail("03b.2", f"rank {r}'s parameters differ from one process by {diff:.1e}: train on "
             "this rank's batches in order, one optimizer step per batch, while every rank "
             "still has one")  # fmt: skip
    return steps


def check_train_while_all_have_data(train_while_all_have_data) -> None:
    """Exercise 03b.2: ``train_while_all_have_data(model, optimizer, batches) -> steps``: DDP
    training over this rank's iterator of batches, every rank stopping at the same step."""
    from ..launcher import LaunchError, RankTimeoutError

    for lengths in ((3, 5), (4, 4), (6, 2, 4), (1, 3, 2)):
        try:
            launch_check("03b.2", _uneven_worker, len(lengths), lengths=lengths,
                         train_while_all_have_data=train_while_all_have_data, timeout=20)  # fmt: skip
        except LaunchError as e:  # a hang, or a rank whose peer had already left
            what = "hung" if isinstance(e, RankTimeoutError) else "failed (a peer had left)"
            raise ExerciseError(
                f"exercise 03b.2: with {list(lengths)} batches on {len(lengths)} ranks the ranks "
                f"{what}: a rank ran a step (its backward's all-reduce) that the others did not "
                "join. Before each step, agree with the other ranks whether every rank still "
                "has a batch."
            ) from None
    passed("03b.2", "every rank stops when the first runs out, equal to one process, on 2 and "
           "3 ranks with uneven data")  # fmt: skip


__all__ = ["check_sync_batch_stats", "check_train_while_all_have_data"]
