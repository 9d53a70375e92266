"""Notebook 03's exercise checks (03.1 ring all-reduce, 03.2 overlapped DDP), on real gloo ranks:
the model answer passes; typical wrong ones and bypasses get the hint, never the answer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_utils import checks
from course_utils.data_parallel import BucketedDDP, BucketedNoOverlapDDP
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- 03.1 ring all-reduce (real ranks) --------------------------------------------------------


def exchange(send_buf, dst, recv_buf, src):
    ops = [dist.P2POp(dist.isend, send_buf, dst), dist.P2POp(dist.irecv, recv_buf, src)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def ring_all_reduce(t, all_gather=True):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(t.chunk(n))
    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send_idx, recv_idx = (r - step) % n, (r - step - 1) % n
        exchange(chunks[send_idx], right, incoming, left)
        chunks[recv_idx] += incoming
    for step in range(n - 1 if all_gather else 0):
        send_idx, recv_idx = (r + 1 - step) % n, (r - step) % n
        exchange(chunks[send_idx], right, incoming, left)
        chunks[recv_idx].copy_(incoming)


def reduce_scatter_only(t):
    ring_all_reduce(t, all_gather=False)


@pytest.mark.multiprocess
@pytest.mark.slow  # notebook 03 runs the model answer through this check too
def test_03_1_ring_all_reduce(runs_root, capsys):
    checks.check_ring_all_reduce(ring_all_reduce)
    assert "✓ exercise 03.1" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03_1_without_the_all_gather(runs_root):
    msg = fails(checks.check_ring_all_reduce, reduce_scatter_only, "1 of 2 chunks are right")
    assert msg.startswith("rank ") and "tensor(" not in msg


def all_reduce_then_pretend(t):  # the library does the sum; the exchanges only fake the count
    n, r = dist.get_world_size(), dist.get_rank()
    dist.all_reduce(t)
    incoming = torch.empty_like(t.chunk(n)[0])
    for _ in range(2 * (n - 1)):
        exchange(t.chunk(n)[0].clone(), (r + 1) % n, incoming, (r - 1) % n)


def halves_from_the_library(t):  # reduce-scatter and all-gather as collectives, imported by name
    from torch.distributed import all_gather_into_tensor, reduce_scatter_tensor

    n = dist.get_world_size()
    mine = torch.empty_like(t.chunk(n)[0])
    reduce_scatter_tensor(mine, t)
    all_gather_into_tensor(t, mine)


def straight_to_the_owner(t):  # right sums, right element count, but not a ring on 3 ranks
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(t.chunk(n))
    incoming = torch.empty_like(chunks[0])
    for k in range(1, n):  # reduce: send chunk j straight to rank j
        dst, src = (r + k) % n, (r - k) % n
        exchange(chunks[dst].clone(), dst, incoming, src)
        chunks[r] += incoming
    for k in range(1, n):  # gather: send my summed chunk straight to everyone
        dst, src = (r + k) % n, (r - k) % n
        exchange(chunks[r], dst, incoming, src)
        chunks[src].copy_(incoming)


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03_1_collectives_and_shortcuts_are_refused(runs_root):
    fails(checks.check_ring_all_reduce, all_reduce_then_pretend, "c10d.allreduce_ was called")
    fails(checks.check_ring_all_reduce, halves_from_the_library, "torch.distributed's collectives")
    fails(checks.check_ring_all_reduce, straight_to_the_owner, "sends only to one neighbour")


# ---- 03.2 bucketed DDP overlapped with backward (real ranks) -----------------------------------


class OverlappedDDP(BucketedNoOverlapDDP):
    """The model answer of exercise 03.2; the class attributes make the typical mistakes."""

    divide, none_where_unused, in_backward, asynchronous = True, True, True, True

    def __init__(self, module, bucket_cap_mb=1.0):
        super().__init__(module, bucket_cap_mb)
        self.where = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.pending = []
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _flat(self, bucket):
        grads = [
            (q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in bucket
        ]
        flags = torch.tensor([float(q.grad is not None) for q in bucket], dtype=grads[0].dtype,
                             device=grads[0].device)  # fmt: skip
        return torch.cat([*grads, flags])

    def _launch_next(self):
        bucket = self.buckets[len(self.pending)]
        flat = self._flat(bucket)
        work = dist.all_reduce(flat, async_op=self.asynchronous)
        self.pending.append((work, flat, bucket))

    def _grad_ready(self, p):
        self.ready[self.where[id(p)]] += 1
        while (
            self.in_backward
            and len(self.pending) < len(self.buckets)
            and self.ready[len(self.pending)] == len(self.buckets[len(self.pending)])
        ):
            self._launch_next()

    def finish_gradient_synchronization(self):
        while len(self.pending) < len(self.buckets):
            self._launch_next()
        n = dist.get_world_size() if self.divide else 1
        for work, flat, bucket in self.pending:
            if work is not None:
                work.wait()
            counts = flat[-len(bucket) :].tolist()
            offset = 0
            for p, count in zip(bucket, counts):
                mean = flat[offset : offset + p.numel()].view_as(p) / n
                p.grad = None if count == 0 and self.none_where_unused else mean.clone()
                offset += p.numel()
        self.pending, self.ready = [], [0] * len(self.buckets)


class SumsWithoutDividing(OverlappedDDP):
    divide = False


class ZerosWhereUnused(OverlappedDDP):
    none_where_unused = False


class AllInFinish(OverlappedDDP):  # correct, but nothing overlaps: (b) with async calls
    in_backward = False


class Blocking(OverlappedDDP):
    asynchronous = False


@pytest.mark.multiprocess
@pytest.mark.slow  # notebook 03 runs the model answer through this check too
def test_03_2_overlapped_ddp(runs_root, capsys):
    checks.check_overlapped_ddp(OverlappedDDP)
    assert "✓ exercise 03.2" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03_2_forgetting_to_divide_says_so(runs_root):
    msg = fails(checks.check_overlapped_ddp, SumsWithoutDividing, "divide the all-reduced sum")
    assert "2 times one process's" in msg and "never completes" not in msg and "tensor(" not in msg


def test_03_2_the_finished_bucketed_ddp_is_refused():  # imported in notebook 03; no ranks start
    for answer in (BucketedDDP, type("Renamed", (BucketedDDP,), {})):
        fails(checks.check_overlapped_ddp, answer, "the package's BucketedDDP")
    # a copy of its methods pasted into a class of the student's is not policed (checks refuse
    # calls, not copies): it is judged by what it does


class Delegating(BucketedNoOverlapDDP):  # keeps the buckets, lets the package's class do the work
    def __init__(self, module, bucket_cap_mb=1.0):
        super().__init__(module, bucket_cap_mb)
        self.ref = BucketedDDP(module, bucket_cap_mb)

    def finish_gradient_synchronization(self):
        self.ref.finish_gradient_synchronization()


class TorchInside(BucketedNoOverlapDDP):  # torch's DDP with a comm hook that all-reduces in Python
    def __init__(self, module, bucket_cap_mb=1.0):
        super().__init__(module, bucket_cap_mb)
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)

    def forward(self, *args):
        return self.ddp(*args)

    def finish_gradient_synchronization(self):
        pass


class LazyDelegating(BucketedNoOverlapDDP):  # builds the package's class only once training runs
    def forward(self, *args):
        if not hasattr(self, "ref"):
            self.ref = BucketedDDP(self.module, 0.002)
        return self.module(*args)

    def finish_gradient_synchronization(self):
        self.ref.finish_gradient_synchronization()


class LazyTorchInside(BucketedNoOverlapDDP):  # torch's DDP built at the first forward
    def forward(self, *args):
        if not hasattr(self, "ddp"):
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.module)
        return self.ddp(*args)

    def finish_gradient_synchronization(self):
        pass


class ImportedAllReduce(OverlappedDDP):  # right, with all_reduce imported by name
    def _launch_next(self):
        from torch.distributed import all_reduce

        bucket = self.buckets[len(self.pending)]
        flat = self._flat(bucket)
        self.pending.append((all_reduce(flat, async_op=True), flat, bucket))


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03_2_the_package_or_torch_inside_is_refused(runs_root):
    fails(checks.check_overlapped_ddp, Delegating, "the package's BucketedDDP")
    fails(checks.check_overlapped_ddp, TorchInside, "torch's DistributedDataParallel")
    fails(checks.check_overlapped_ddp, LazyDelegating, "the package's BucketedDDP")
    fails(checks.check_overlapped_ddp, LazyTorchInside, "torch's DistributedDataParallel")


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03_2_all_reduce_imported_by_name_is_watched_too(runs_root, capsys):
    checks.check_overlapped_ddp(ImportedAllReduce)
    assert "✓ exercise 03.2" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03_2_zeros_where_no_rank_had_a_gradient(runs_root):
    fails(checks.check_overlapped_ddp, ZerosWhereUnused, "leave .grad None", ["tensor("])


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_03_2_no_overlap_or_a_blocking_call_is_caught(runs_root):
    fails(checks.check_overlapped_ddp, AllInFinish, "started during backward")
    fails(checks.check_overlapped_ddp, Blocking, "async_op=True")
