"""Notebook 03b's exercise checks (03b.1 SyncBatchNorm's statistics, 03b.2 uneven data), on real
gloo ranks: right answers pass; typical wrong ones and bypasses get the hint.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils import checks
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- 03b.1 SyncBatchNorm's statistics, 03b.2 stopping together (real ranks) --------------------


def sync_batch_stats(x):  # the model answer: per-rank count, mean and M2, all-gathered
    dims = [0, *range(2, x.dim())]
    c, count = x.shape[1], x.numel() // x.shape[1]
    mean = x.mean(dims)
    m2 = ((x - mean.view(1, c, *[1] * (x.dim() - 2))) ** 2).sum(dims)
    mine = torch.cat([torch.tensor([float(count)], dtype=x.dtype, device=x.device), mean, m2])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    s = torch.stack(every)
    counts, means, m2s = s[:, :1], s[:, 1 : 1 + c], s[:, 1 + c :]
    total = counts.sum()
    g = (counts * means).sum(0) / total
    return g, (m2s + counts * (means - g) ** 2).sum(0) / total


def two_passes(x):  # also right: the global mean first, then the squares around it
    dims = [0, *range(2, x.dim())]
    c = x.shape[1]
    sums = torch.cat([x.sum(dims), torch.tensor([x.numel() / c], dtype=x.dtype, device=x.device)])
    dist.all_reduce(sums)
    mean = sums[:c] / sums[c]
    sq = ((x - mean.view(1, c, *[1] * (x.dim() - 2))) ** 2).sum(dims)
    dist.all_reduce(sq)
    return mean, sq / sums[c]


def sums_of_squares(x):  # E[x²] − E[x]²: right in float64, cancels in float32 around 1e4
    dims = [0, *range(2, x.dim())]
    count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
    stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
    dist.all_reduce(stats)
    c = x.shape[1]
    mean = stats[:c] / stats[-1]
    return mean, stats[c : 2 * c] / stats[-1] - mean**2


def mean_of_means(x):
    dims = [0, *range(2, x.dim())]
    m, v = x.mean(dims), x.var(dims, unbiased=False)
    dist.all_reduce(m)
    dist.all_reduce(v)
    return m / dist.get_world_size(), v / dist.get_world_size()


def unbiased(x):
    mean, var = two_passes(x)
    count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
    dist.all_reduce(count)
    return mean, var * count / (count - 1)


def gathered(x):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, x.cpu())
    whole = torch.cat(parts)
    dims = [0, *range(2, x.dim())]
    return whole.mean(dims), whole.var(dims, unbiased=False)


def broadcast_everything(x):  # the samples through another collective, one rank at a time
    dims = [0, *range(2, x.dim())]
    parts = []
    for q in range(dist.get_world_size()):
        size = torch.tensor([x.shape[0]], device=x.device)
        dist.broadcast(size, q)
        part = x.clone() if q == dist.get_rank() else x.new_empty(int(size), *x.shape[1:])
        dist.broadcast(part, q)
        parts.append(part)
    whole = torch.cat(parts)
    return whole.mean(dims), whole.var(dims, unbiased=False)


def torch_kernels(x):  # SyncBatchNorm's own kernels, through torch.ops
    c = x.shape[1]
    mean, invstd = torch.ops.aten.batch_norm_stats(x, 1e-5)
    return mean, invstd.new_zeros(c)


@pytest.mark.multiprocess
def test_03b_1_sync_batch_stats(runs_root, capsys):
    checks.check_sync_batch_stats(sync_batch_stats)
    checks.check_sync_batch_stats(two_passes)
    assert capsys.readouterr().out.count("✓ exercise 03b.1") == 2


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03b_1_typical_mistakes_and_bypasses(runs_root):
    fails(checks.check_sync_batch_stats, sums_of_squares, "nearly equal sums")
    fails(checks.check_sync_batch_stats, mean_of_means, "weighs every rank alike")
    fails(checks.check_sync_batch_stats, unbiased, "biased variance")
    fails(checks.check_sync_batch_stats, gathered, "sends statistics")
    fails(checks.check_sync_batch_stats, broadcast_everything, "all_reduce or all_gather only")
    fails(checks.check_sync_batch_stats, torch_kernels, "SyncBatchNorm's own kernels")


def train_with_uneven_data(model, optimizer, batches):  # the model answer: Join's core
    params = list(model.parameters())
    steps = 0
    while True:
        batch = next(batches, None)
        optimizer.zero_grad()
        if batch is not None:
            x, y = batch
            nn.functional.cross_entropy(model(x), y).backward()
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
        ]
        have = torch.tensor([0.0 if batch is None else 1.0], dtype=grads[0].dtype)
        flat = torch.cat([*grads, have.to(grads[0].device)])
        dist.all_reduce(flat)
        active = flat[-1].item()
        if active == 0:
            return steps
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p) / active
            offset += p.numel()
        optimizer.step()
        steps += 1


def stop_at_the_first(model, optimizer, batches):  # the other fix: all stop with the shortest
    device, steps = next(model.parameters()).device, 0
    while True:
        batch = next(batches, None)
        have = torch.tensor([0 if batch is None else 1], device=device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item() == 0:
            return steps
        x, y = batch
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        steps += 1


def divide_by_all(model, optimizer, batches):  # Join's default: divide by the initial world size
    params = list(model.parameters())
    steps = 0
    while True:
        batch = next(batches, None)
        optimizer.zero_grad()
        if batch is not None:
            nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
        ]
        have = torch.tensor([float(batch is not None)], dtype=grads[0].dtype)
        flat = torch.cat([*grads, have.to(grads[0].device)])
        dist.all_reduce(flat)
        if flat[-1].item() == 0:
            return steps
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p) / dist.get_world_size()
            offset += p.numel()
        optimizer.step()
        steps += 1


def counted_first(model, optimizer, batches):  # reads every batch up front to count them
    everything = list(batches)
    return train_with_uneven_data(model, optimizer, iter(everything))


def each_on_its_own(model, optimizer, batches):
    steps = 0
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        steps += 1
    return steps


def announces_the_end_alone(model, optimizer, batches):  # a finished rank sends a flag, alone
    steps = 0
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        steps += 1
    done = torch.ones(1, device=next(model.parameters()).device)
    dist.all_reduce(done)  # the others are still all-reducing gradients
    dist.barrier()
    return steps + 100  # never reached in a correct run


def with_join(model, optimizer, batches):
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    with Join([ddp]):
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
    return 0


@pytest.mark.multiprocess
def test_03b_2_train_with_uneven_data(runs_root, capsys):
    checks.check_train_with_uneven_data(train_with_uneven_data)
    assert "✓ exercise 03b.2" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03b_2_typical_mistakes_and_bypasses(runs_root):
    fails(checks.check_train_with_uneven_data, stop_at_the_first, "until the last rank runs out")
    fails(checks.check_train_with_uneven_data, divide_by_all, "ranks that still had a batch")
    fails(checks.check_train_with_uneven_data, counted_first, "take one batch per step")
    fails(checks.check_train_with_uneven_data, with_join, "torch's DDP")
    fails(checks.check_train_with_uneven_data, each_on_its_own, "until the last rank runs out")
    check = functools.partial(checks.check_train_with_uneven_data, timeout=10)
    fails(check, announces_the_end_alone, "did not join")
