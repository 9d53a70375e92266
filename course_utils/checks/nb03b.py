"""Checks for notebook 03b (DDP in practice): SyncBatchNorm's statistics combined across ranks,
and Join's core: ranks with uneven data that keep training together until the last is done."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..comm.counting import tensors
from ..launcher import LaunchError, RankTimeoutError
from ..measure import max_abs_diff
from ..models import ToyMLP
from .common import (
    ExerciseError,
    OnlyCommunication,
    RefuseTorch,
    fail,
    launch_check,
    no_store,
    passed,
)

GATHERING = (
    "SyncBatchNorm sends statistics, a few numbers per channel and rank, whatever the batch; "
    "send those, not the samples"
)
# bytes a rank may pass to collectives per call, whatever its batch: a few numbers per channel,
# and the pickling around them when they travel as objects (all_gather_object)
ALLOWANCE_BYTES, PER_CHANNEL_BYTES = 4096, 64
OTHER_COLLECTIVE = (
    "send statistics with all_reduce or all_gather only (SyncBatchNorm all-gathers them); "
    "other collectives and point-to-point messages are not needed"
)
BUILT_IN = (
    "write the combination yourself: torch's batch_norm_stats / batch_norm_gather_stats* are "
    "SyncBatchNorm's own kernels"
)
# what SyncBatchNorm's statistics may travel with, across torch versions and call styles
STATS_OPS = (
    "allreduce_",
    "allgather_",
    "_allgather_base_",
    "allgather_into_tensor_coalesced_",
    "all_gather_single_",
    "all_gather_single",
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_into_tensor_out",
)
BATCH_NORM_OPS = (
    "batch_norm_stats",
    "batch_norm_gather_stats",
    "batch_norm_gather_stats_with_counts",
    "batch_norm_elemt",
    "batch_norm_update_stats",
)


class _StatisticsOnly(OnlyCommunication):
    """Refuses other collectives (OnlyCommunication) and torch's batch-norm kernels however they are
    called (``torch.batch_norm_stats``, ``torch.ops.aten...``); adds up the bytes of every tensor
    handed to a collective (``self.sent``), outputs included."""

    def __init__(self):
        super().__init__("03b.1", STATS_OPS, OTHER_COLLECTIVE)
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1]
        if namespace == "aten" and name in BATCH_NORM_OPS:
            fail("03b.1", BUILT_IN)
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            sent = tensors(args) + tensors(list((kwargs or {}).values()))
            self.sent += sum(t.numel() * t.element_size() for t in sent)
        return super().__torch_dispatch__(func, types, args, kwargs)


# (rows of rank 0, then per rank 5 more; the channel dimension; the rest), an offset and a spread:
# the last case is float32 with values around 1e4 and a spread of 1, where E[x²] − E[x]² cancels
CASES = [
    ((12, 3), torch.float64, 1.0, 1.0),
    ((6, 5, 6), torch.float64, 1.0, 1.0),
    ((4, 2, 3, 3), torch.float64, 1.0, 1.0),
    ((16, 4, 8), torch.float32, 1e4, 1.0),
    ((1000, 3), torch.float64, 1.0, 1.0),  # samples far larger than any statistics
    ((10, 3), torch.float64, 1e8, 1.0),  # E[x²] − E[x]² cancels in float64 too, around 1e8
]


def _stats_worker(ctx, sync_batch_stats, cases):
    n, r = ctx.world_size, ctx.rank
    for shape, dtype, offset, spread in cases:
        batches = []
        for q in range(n):  # every rank's batch: sizes differ, and so do their means
            g = torch.Generator().manual_seed(100 * q + len(shape))
            rows = shape[0] + 5 * q
            noise = torch.randn(rows, *shape[1:], generator=g, dtype=torch.float64)
            batches.append(noise * spread + offset + 0.5 * q * spread)
        x = batches[r].to(ctx.device, dtype)
        watch = _StatisticsOnly()
        with RefuseTorch("03b.1", BUILT_IN, funcs=_torch_batch_norm()), watch, no_store("03b.1"):
            got = sync_batch_stats(x)
        # every tensor handed to a collective counted once, outputs too: an all-gather of k bytes
        # counts (n + 1) k, so the budget and the samples are both counted that way
        budget = (n + 1) * (ALLOWANCE_BYTES + PER_CHANNEL_BYTES * x.shape[1])
        samples = (n + 1) * x.numel() * x.element_size()
        if watch.sent > budget and samples > budget:
            fail("03b.1", f"on {n} ranks, rank {r} handed {watch.sent} bytes to collectives for a "
                 f"batch of {x.numel() * x.element_size()} bytes, as much as its samples: "
                 f"{GATHERING}")  # fmt: skip
        if not (isinstance(got, tuple) and len(got) == 2):
            fail("03b.1", "return (mean, var), one value per channel each")
        mean, var = (t.detach().cpu().double() for t in got)
        whole = torch.cat(batches)  # one process sees every rank's batch, in float64
        dims = [0, *range(2, whole.dim())]  # every dimension but the channels
        want_mean, want_var = whole.mean(dims), whole.var(dims, unbiased=False)
        where = (
            f"on {n} ranks with batches of {[b.shape[0] for b in batches]}, shape "
            f"{tuple(x.shape)}, {str(dtype).replace('torch.', '')}"
        )
        if tuple(mean.shape) != tuple(want_mean.shape) or tuple(var.shape) != tuple(want_var.shape):
            fail("03b.1", f"{where}: mean and var must have one value per channel, shape "
                 f"{tuple(want_mean.shape)}")  # fmt: skip
        tol = 1e-10 if dtype == torch.float64 else 1e-6
        if not torch.allclose(mean, want_mean, rtol=tol, atol=tol * spread):
            equal_weights = torch.stack([b.mean(dims) for b in batches]).mean(0)
            if torch.allclose(mean, equal_weights, rtol=tol, atol=tol * spread):
                hint = (
                    "the mean of the ranks' means weighs every rank alike, but their batches "
                    "differ in size: weigh each rank by its number of values"
                )
            else:
                hint = "the global mean is the sum of every rank's values over their number"
            fail("03b.1", f"{where}: your mean is wrong: {hint}.")
        vtol = 1e-9 if dtype == torch.float64 else 1e-3
        # around 1e8 even float64 keeps the variance only to about 1e-8 (x − mean loses that much)
        if not torch.allclose(
            var, want_var, rtol=vtol, atol=max(vtol * spread**2, 1e-22 * offset**2)
        ):
            count = whole.numel() // whole.shape[1]
            if torch.allclose(var, want_var * count / (count - 1), rtol=vtol, atol=1e-12):
                hint = "BatchNorm normalises with the biased variance (divide by N, not N - 1)"
            elif dtype == torch.float32 or offset > 1e6:
                hint = (
                    f"off by up to {(var - want_var).abs().max().item():.2g} where the values sit "
                    f"around {offset:g} with a spread of {spread:g}: a difference of two large, "
                    "nearly equal sums (E[x²] − E[x]²) keeps only their last digits (float32's, or "
                    "float64's around 1e8). Combine quantities measured around a mean instead"
                )
            else:
                hint = (
                    "the variance of the union is not the mean of the ranks' variances: each "
                    "rank's values spread around its own mean, and those means spread around the "
                    "global one"
                )
            fail("03b.1", f"{where}: your variance is wrong: {hint}.")
    return True


def _torch_batch_norm() -> list:
    names = ("batch_norm_stats", "batch_norm_gather_stats", "batch_norm_gather_stats_with_counts",
             "batch_norm_elemt", "batch_norm_update_stats")  # fmt: skip
    return [getattr(torch, f) for f in names if hasattr(torch, f)]


def check_sync_batch_stats(sync_batch_stats) -> None:
    """Exercise 03b.1: ``sync_batch_stats(x)``: the mean and (biased) variance per channel over every
    rank's batch, as SyncBatchNorm normalises with, from per-rank statistics, exact in float32 too."""
    for n in (2, 3):
        launch_check("03b.1", _stats_worker, n, sync_batch_stats=sync_batch_stats,
                     cases=CASES, timeout=90)  # fmt: skip
    passed("03b.1", "the global mean and variance on 2 and 3 ranks with batches of different "
           "sizes, for (N, C), (N, C, L) and (N, C, H, W) inputs, in float32 around 1e4 too, "
           "without sending the data")  # fmt: skip


JOIN = "write it yourself: torch's Join (with DDP's join hook) is what this exercise rebuilds"
DDP_REFUSED = (
    "the model comes unwrapped on purpose: average the gradients yourself; torch's DDP divides by "
    "every rank, not by the ranks that still had data"
)
AHEAD = (
    "your function read batch {k} before taking step {k}: take one batch per step. A data loader "
    "streams its batches; it cannot be counted in advance"
)


@contextlib.contextmanager
def _no_join_no_ddp():
    from torch.distributed.algorithms import join
    from torch.nn.parallel import DistributedDataParallel

    saved = join.Join.__init__, DistributedDataParallel.__init__

    def refuse_join(*args, **kwargs):
        fail("03b.2", JOIN)

    def refuse_ddp(*args, **kwargs):
        fail("03b.2", DDP_REFUSED)

    join.Join.__init__, DistributedDataParallel.__init__ = refuse_join, refuse_ddp
    try:
        yield
    finally:
        join.Join.__init__, DistributedDataParallel.__init__ = saved


class _Streaming:
    """This rank's batches, one per optimizer step: batch k only once k steps were taken."""

    def __init__(self, batches, optimizer):
        held = tuple(batches)  # in a closure: no attribute tells how many there are
        self._take = lambda k: held[k] if k < len(held) else None
        self.optimizer, self.k = optimizer, 0
        self.steps = 0
        step = optimizer.step

        self.after_first = None  # the parameters after the first step, to tell when they part

        def counted(*args, **kwargs):
            self.steps += 1
            out = step(*args, **kwargs)
            if self.steps == 1:
                self.after_first = [q.detach().clone() for g in optimizer.param_groups
                                    for q in g["params"]]  # fmt: skip
            return out

        optimizer.step = counted

    def __iter__(self):
        return self

    def __getattr__(self, name):  # only for names the stream does not have
        if name.startswith("__"):
            raise AttributeError(name)
        fail("03b.2", f"batches has no attribute {name!r}: it is a stream, read with next() or a "
             "for loop, one batch per step. A data loader streams its batches; how many a rank "
             "has is not known in advance")  # fmt: skip

    def __next__(self):
        if self.k > self.steps:
            fail("03b.2", AHEAD.format(k=self.k))
        batch = self._take(self.k)
        if batch is None:
            raise StopIteration
        self.k += 1
        return batch


MISTAKES = {  # what a wrong answer's parameters can equal, and what that one process did
    "world": "divides every step's summed gradient by all the ranks: once a rank has run out, "
    "divide by the ranks that still had a batch",
    "sum": "sums the ranks' gradients: the step takes their mean, over the ranks that still had a "
    "batch",
    "no_zero": "never zeroes its gradients, so every step adds the earlier steps' gradients: "
    "zero them before each step's backward (a finished rank's too)",
}


def _one_process(data, lengths, device, variant="mean", steps=None):
    """The parameters one process reaches on every rank's batches, each step averaging the ranks
    that still had a batch (``mean``), or one of the :data:`MISTAKES`."""
    torch.manual_seed(0)
    reference = ToyMLP().double().to(device)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    n = len(lengths)
    for s in range(max(lengths) if steps is None else steps):
        if variant != "no_zero":
            opt.zero_grad()
        active = [q for q in range(n) if s < lengths[q]]
        divisor = {"mean": len(active), "world": n, "sum": 1, "no_zero": len(active)}[variant]
        for q in active:
            x, y = data[q][s]
            loss = nn.functional.cross_entropy(reference(x.to(device)), y.to(device))
            (loss / divisor).backward()
        opt.step()
    return list(reference.parameters())


def _uneven_worker(ctx, train_with_uneven_data, lengths):
    n, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    model = ToyMLP().double().to(ctx.device)
    # momentum: a rank that skipped a step would drift from the others for good
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = []
    for q in range(n):
        g = torch.Generator().manual_seed(q)
        data.append([(torch.randn(4, 16, generator=g, dtype=torch.float64),
                      torch.randint(4, (4,), generator=g)) for _ in range(lengths[q])])  # fmt: skip
    mine = [(x.to(ctx.device), y.to(ctx.device)) for x, y in data[r]]
    stream = _Streaming(mine, opt)
    with _no_join_no_ddp(), no_store("03b.2"):
        steps = train_with_uneven_data(model, opt, stream)
    longest = max(lengths)
    if steps != longest:
        fail("03b.2", f"rank {r} took {steps} steps with {lengths[r]} batches, the ranks having "
             f"{lengths}: training goes on until the last rank runs out, {longest} steps on "
             "every rank")  # fmt: skip
    everyone = [None] * n  # every rank's parameters, to tell a rank that went its own way
    dist.all_gather_object(everyone, [p.detach().cpu() for p in model.parameters()])
    diff = max_abs_diff(zip(model.parameters(), _one_process(data, lengths, ctx.device, "mean")))
    if not diff <= 1e-12:  # a NaN fails too
        shorter = [q for q in range(n) if lengths[q] < longest]
        where = (f"rank {r}'s parameters differ from one process by {diff:.1e} after {longest} "
                 f"steps with {list(lengths)} batches")  # fmt: skip
        apart = max(max_abs_diff(zip(everyone[0], other)) for other in everyone)
        if not apart <= 1e-12:
            fail("03b.2", f"{where}, and the ranks ended with different parameters: every rank, "
                 f"finished or not, takes every step (rank(s) {shorter} ran out early), with the "
                 "same averaged gradient")  # fmt: skip
        for variant, hint in MISTAKES.items():
            ref = _one_process(data, lengths, ctx.device, variant)
            if max_abs_diff(zip(model.parameters(), ref)) <= 1e-12:
                fail("03b.2", f"{where}: they equal one process that {hint}")
        first = _one_process(data, lengths, ctx.device, "mean", steps=1)
        if stream.after_first and max_abs_diff(zip(stream.after_first, first)) <= 1e-12:
            fail("03b.2", f"{where}, though the first step equals one process's: something is "
                 "carried from one step to the next, most often gradients not zeroed before the "
                 "next backward (a finished rank's too)")  # fmt: skip
        fail("03b.2", f"{where}: once rank(s) {shorter} ran out, one process averages over the "
             "ranks that still had a batch (not over all of them), and every rank, finished or "
             "not, takes that same step")  # fmt: skip
    return steps


def _mismatched(error) -> bool:
    """Whether a rank failed in the communication itself: a peer that had closed its connections,
    or a collective that did not match the others' (gloo aborts the process on a size mismatch)."""
    text = str(error).lower()
    return any(w in text for w in ("connection closed", "connection reset", "broken pipe",
                                   "peer", "mismatch", "gloo::", "nccl"))  # fmt: skip


def check_train_with_uneven_data(train_with_uneven_data, timeout: float = 60) -> None:
    """Exercise 03b.2: ``train_with_uneven_data(model, optimizer, batches) -> steps``: every rank
    trains until the last rank runs out of batches; each step's gradient is the mean over the ranks
    that still had a batch, and every rank takes it: equal to one process, without Join or DDP."""

    for lengths in ((3, 5), (4, 4), (6, 2, 4), (1, 3, 2)):
        try:
            launch_check("03b.2", _uneven_worker, len(lengths), lengths=lengths,
                         train_with_uneven_data=train_with_uneven_data,
                         timeout=timeout)  # fmt: skip
        except LaunchError as e:  # a hang, or a rank whose peer had already left
            if isinstance(e, RankTimeoutError):
                what = "hung"
            elif _mismatched(e):
                what = "failed in their communication"
            else:
                raise  # the student's own error, with its traceback
            raise ExerciseError(
                f"exercise 03b.2: with {list(lengths)} batches on {len(lengths)} ranks the ranks "
                f"{what}: a rank issued a collective that the others did not join. Every rank "
                "must take part in every step's communication, with or without a batch of its own."
            ) from None
    passed("03b.2", "equal to one process on 2 and 3 ranks with uneven data: every step averages "
           "the ranks that still had a batch, and every rank takes it")  # fmt: skip


__all__ = ["check_sync_batch_stats", "check_train_with_uneven_data"]
