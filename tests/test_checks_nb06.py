"""The exercise checks: a right answer passes; typical wrong ones get the hint, never the answer.

Each right answer is the model answer's logic from the notebook; the wrong ones are the mistakes
the checks' hints are written for. The 03.x checks start real gloo ranks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils import checks
from course_utils.checks import ExerciseError
from course_utils.checks.nb01 import _cases, _reference
from course_utils.data_parallel import BucketedDDP, BucketedNoOverlapDDP
from course_utils.measure import saved_activations
from course_utils.pipeline.partition import balanced_split as reference_split
from course_utils.pipeline.simulate import schedule_order, simulate
from course_utils.profiling import collectives
from course_utils.profiling.analysis import classify_name, subtract, union
from course_utils.zero.memory import count_model_states as package_count

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


def fails(check, answer, hint: str, absent=()) -> str:
    """Run ``check(answer)``: it must raise ExerciseError naming ``hint`` and none of ``absent``."""
    with pytest.raises(ExerciseError) as info:
        check(answer)
    message = str(info.value)
    assert hint in message, message
    for value in absent:
        assert str(value) not in message, f"{value!r} (the expected answer) in: {message}"
    return message


# ---- 01.1 state bytes -------------------------------------------------------------------------


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(model, optimizer):
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": _nbytes(params), "gradients": _nbytes(grads), "optimizer": _nbytes(state)}


def _expected_01_1(label: str, key: str) -> int:
    (found,) = [_reference(m, o)[key] for lab, m, o in _cases() if lab == label]
    return found


def test_01_1_state_bytes(capsys):
    checks.check_state_bytes(state_bytes)
    assert "✓ exercise 01.1" in capsys.readouterr().out


def test_01_1_frozen_parameters_have_no_gradient():
    def grads_of_every_parameter(model, optimizer):
        out = state_bytes(model, optimizer)
        out["gradients"] = _nbytes(model.parameters())
        return out

    want = _expected_01_1("a model with a frozen layer, Adam", "gradients")
    fails(checks.check_state_bytes, grads_of_every_parameter, "frozen parameters", [want])


def test_01_1_step_counters_are_state():
    def without_step(model, optimizer):
        out = state_bytes(model, optimizer)
        state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        out["optimizer"] = _nbytes(state)
        return out

    want = _expected_01_1("an MLP with Adam", "optimizer")
    fails(checks.check_state_bytes, without_step, "the step counters included", [want])


# ---- 01.2 activation bytes --------------------------------------------------------------------


def mlp_activation_bytes(batch, widths, dtype=torch.float32, activation="relu"):
    size_of = torch.tensor([], dtype=dtype).element_size()
    per_hidden = (
        1 if activation == "relu" else 2
    )  # GELU keeps its input; the next Linear, its output
    kept = [widths[0]] + [w for w in widths[1:-1] for _ in range(per_hidden)]
    return sum(batch * w * size_of for w in kept)


FIRST_CASE_BYTES = 8 * (16 + 32) * 4  # batch 8, widths [16, 32, 4], float32


def test_01_2_activation_bytes(capsys):
    checks.check_mlp_activation_bytes(mlp_activation_bytes)
    assert "✓ exercise 01.2" in capsys.readouterr().out


def test_01_2_typical_mistakes():
    def without_input(batch, widths, dtype=torch.float32, activation="relu"):
        size_of = torch.tensor([], dtype=dtype).element_size()
        return mlp_activation_bytes(batch, widths, dtype, activation) - batch * widths[0] * size_of

    def relu_twice(batch, widths, dtype=torch.float32, activation="relu"):
        return mlp_activation_bytes(batch, widths, dtype, "gelu")  # one tensor counted twice

    def gelu_like_relu(batch, widths, dtype=torch.float32, activation="relu"):
        return mlp_activation_bytes(batch, widths, dtype, "relu")

    absent = [FIRST_CASE_BYTES]
    fails(checks.check_mlp_activation_bytes, without_input, "the first Linear needs", absent)
    fails(checks.check_mlp_activation_bytes, relu_twice, "count it once", absent)
    fails(checks.check_mlp_activation_bytes, gelu_like_relu, "GELU's derivative", absent)


def test_01_2_measuring_is_refused():
    def measured(batch, widths, dtype=torch.float32, activation="relu"):  # saved_activations
        layers = []
        for i in range(len(widths) - 1):
            layers += [nn.Linear(widths[i], widths[i + 1]), nn.ReLU()]
        model = nn.Sequential(*layers[:-1]).to(dtype)
        with saved_activations() as mem:
            model(torch.randn(batch, widths[0], dtype=dtype))
        return mem["bytes"]

    assert measured(8, [16, 32, 4]) == FIRST_CASE_BYTES  # it would pass without the guard
    fails(checks.check_mlp_activation_bytes, measured, "autograd recorded", [FIRST_CASE_BYTES])
    # the guard is gone afterwards: autograd records again
    assert nn.Linear(2, 2)(torch.randn(1, 2)).grad_fn is not None


# ---- 01.3 gradient accumulation ---------------------------------------------------------------


def accumulated_step(model, optimizer, x, y, k):
    optimizer.zero_grad(set_to_none=True)
    for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
        (nn.functional.cross_entropy(model(xm), ym) * len(xm) / len(x)).backward()
    optimizer.step()


def test_01_3_accumulated_step(capsys):
    checks.check_accumulated_step(accumulated_step)
    assert "✓ exercise 01.3" in capsys.readouterr().out


def test_01_3_typical_mistakes():
    def divided_by_k(model, optimizer, x, y, k):
        optimizer.zero_grad()
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            (nn.functional.cross_entropy(model(xm), ym) / k).backward()
        optimizer.step()

    def stale_gradients(model, optimizer, x, y, k):
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            (nn.functional.cross_entropy(model(xm), ym) * len(xm) / len(x)).backward()
        optimizer.step()

    def step_per_micro_batch(model, optimizer, x, y, k):
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xm), ym).backward()
            optimizer.step()

    def whole_batch(model, optimizer, x, y, k):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    fails(checks.check_accumulated_step, divided_by_k, "weigh each micro-batch's mean loss")
    fails(checks.check_accumulated_step, stale_gradients, "clear last step's gradients")
    fails(checks.check_accumulated_step, step_per_micro_batch, "step once")
    fails(checks.check_accumulated_step, whole_batch, "micro-batches of at most")


def state_via_package(model, optimizer):  # as a notebook cell writes it: the import is global
    s = package_count(model, optimizer)
    return {k: s.bytes(k) for k in ("parameters", "gradients", "optimizer")}


def test_01_1_the_package_count_is_refused():
    fails(
        checks.check_state_bytes, state_via_package, "count_model_states is this exercise's answer"
    )
    fails(checks.check_state_bytes, package_count, "count_model_states")
    from course_utils.checks.nb01 import _reference

    fails(checks.check_state_bytes, _reference, "count_model_states")  # the check's own, too


# ---- 02.1 the DataParallel step, 02.2 without the gather ---------------------------------------


def _reduce(model, replicas):
    for p, *copies in zip(model.parameters(), *(r.parameters() for r in replicas)):
        grads = [c.grad for c in copies if c.grad is not None]
        p.grad = sum(grads) if grads else None


def data_parallel_step(model, x, y, k, reduce=_reduce, threads=True):
    import copy
    from concurrent.futures import ThreadPoolExecutor

    chunks = x.chunk(k)
    replicas = [copy.deepcopy(model) for _ in chunks]
    if threads:
        with ThreadPoolExecutor(len(chunks)) as pool:
            outs = list(pool.map(lambda a: a[0](a[1]), zip(replicas, chunks)))
    else:
        outs = [r(c) for r, c in zip(replicas, chunks)]
    loss = nn.functional.cross_entropy(torch.cat(outs), y)
    loss.backward()
    reduce(model, replicas)
    return loss.detach()


def local_loss_step(model, x, y, k, weight=lambda xc, x, n: len(xc) / len(x), join=sum):
    import copy
    from concurrent.futures import ThreadPoolExecutor

    chunks = list(zip(x.chunk(k), y.chunk(k)))
    replicas = [copy.deepcopy(model) for _ in chunks]

    def run(a):
        r, (xc, yc) = a
        share = nn.functional.cross_entropy(r(xc), yc) * weight(xc, x, len(chunks))
        share.backward()
        return share.detach() if join is sum else share

    with ThreadPoolExecutor(len(chunks)) as pool:
        shares = list(pool.map(run, zip(replicas, chunks)))
    _reduce(model, replicas)
    return join(shares)


def test_02_1_data_parallel_step(capsys):
    checks.check_data_parallel_step(data_parallel_step)
    assert "✓ exercise 02.1" in capsys.readouterr().out


def test_02_1_typical_mistakes():
    def averaged(model, replicas):
        _reduce(model, replicas)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= len(replicas)

    def zeros_for_missing(model, replicas):
        for p, *copies in zip(model.parameters(), *(r.parameters() for r in replicas)):
            p.grad = sum((c.grad for c in copies if c.grad is not None), torch.zeros_like(p))

    def with_(**kw):
        return lambda model, x, y, k: data_parallel_step(model, x, y, k, **kw)

    fails(checks.check_data_parallel_step, with_(reduce=averaged), "sum them, do not average")
    fails(checks.check_data_parallel_step, with_(reduce=zeros_for_missing), "get no gradient")
    fails(checks.check_data_parallel_step, with_(threads=False), "a thread of its own")


def test_02_1_bypasses_are_refused():
    from course_utils.checks.nb02 import _reference_step

    def plain_data_parallel(model, x, y, k):  # on the CPU: a plain call of the model
        loss = nn.functional.cross_entropy(nn.DataParallel(model)(x), y)
        loss.backward()
        return loss.detach()

    def one_device(model, x, y, k):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()

    fails(checks.check_data_parallel_step, plain_data_parallel, "DataParallel and its pieces")
    fails(checks.check_data_parallel_step, one_device, "scatter the batch")
    fails(checks.check_data_parallel_step, _reference_step, "the check's own copy")

    def from_a_thread(model, x, y, k):  # the refusal swaps the code: every thread sees it
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(_reference_step, model, x, y, k).result()

    fails(checks.check_data_parallel_step, from_a_thread, "the check's own copy")
    assert nn.DataParallel(nn.Linear(2, 2))  # and DataParallel works again


@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_02_bypasses_a_reviewer_found_are_caught():
    """One device in disguise (decoy replicas, then model.forward on the whole batch), shallow
    copies that share the model's parameters, one worker thread running the replicas in turn, and
    a gather hidden behind another loss function."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    def decoys(model, x, y, k):
        with torch.no_grad(), ThreadPoolExecutor(1) as pool:
            list(pool.map(lambda c: copy.deepcopy(model)(c), x.chunk(k)))
        loss = nn.functional.cross_entropy(model.forward(x), y)
        loss.backward()
        return loss.detach()

    def shallow(model, x, y, k):
        chunks = x.chunk(k)
        replicas = [copy.copy(model) for _ in chunks]
        with ThreadPoolExecutor(len(chunks)) as pool:
            outs = list(pool.map(lambda a: a[0](a[1]), zip(replicas, chunks)))
        loss = nn.functional.cross_entropy(torch.cat(outs), y)
        loss.backward()
        return loss.detach()

    def one_worker(model, x, y, k):
        chunks = x.chunk(k)
        replicas = [copy.deepcopy(model) for _ in chunks]
        with ThreadPoolExecutor(1) as pool:
            outs = list(pool.map(lambda a: a[0](a[1]), zip(replicas, chunks)))
        loss = nn.functional.cross_entropy(torch.cat(outs), y)
        loss.backward()
        _reduce(model, replicas)
        return loss.detach()

    def nll_gather(model, x, y, k):
        chunks = x.chunk(k)
        replicas = [copy.deepcopy(model) for _ in chunks]
        with ThreadPoolExecutor(len(chunks)) as pool:
            outs = list(pool.map(lambda a: a[0](a[1]), zip(replicas, chunks)))
        loss = nn.functional.nll_loss(torch.cat(outs).log_softmax(1), y)
        loss.backward()
        _reduce(model, replicas)
        return loss.detach()

    fails(checks.check_data_parallel_step, decoys, "forward ran on batches of")
    fails(checks.check_data_parallel_step, shallow, "shallow copy shares them")
    fails(checks.check_data_parallel_step, one_worker, "did not run at the same time")
    fails(checks.check_local_loss_step, nll_gather, "gather nothing")


def test_02_2_local_loss_step(capsys):
    checks.check_local_loss_step(local_loss_step)
    assert "✓ exercise 02.2" in capsys.readouterr().out


def test_02_2_the_replicas_losses_may_be_stacked(capsys):
    """Joining the replicas' scalar losses (still attached to their graphs) gathers no outputs: a
    right answer that returns torch.stack(shares).sum() passes (a reader's answer once failed)."""
    for join in (lambda s: torch.stack(s).sum(), lambda s: torch.cat([x.view(1) for x in s]).sum()):
        checks.check_local_loss_step(
            lambda m, x, y, k, join=join: local_loss_step(m, x, y, k, join=join)
        )
        assert "✓ exercise 02.2" in capsys.readouterr().out


def test_02_2_typical_mistakes():
    def divided_by_k(model, x, y, k):
        return local_loss_step(model, x, y, k, weight=lambda xc, x, n: 1 / n)

    def unweighted(model, x, y, k):
        return local_loss_step(model, x, y, k, weight=lambda xc, x, n: 1.0)

    fails(checks.check_local_loss_step, divided_by_k, "in proportion to its samples")
    fails(checks.check_local_loss_step, unweighted, "differs from one device's")
    fails(checks.check_local_loss_step, data_parallel_step, "gather nothing")


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


# ---- 04.1 exposed communication ---------------------------------------------------------------


def exposed_communication_ms(trace, k):
    _, s0, s1 = trace.steps[k]
    cls = np.array([classify_name(n) or "" for n in trace.names], dtype=object)[trace.name_id]
    inside = (trace.end > s0) & (trace.start < s1)
    cpu = ~trace.lane_is_gpu[trace.lane]
    main = trace.lane == trace.main_lane
    is_op = ~trace.name_is_annotation[trace.name_id]

    def clipped(mask):
        return union(np.clip(trace.start[mask], s0, s1), np.clip(trace.end[mask], s0, s1))

    comm = clipped((cls == "communication") & cpu & inside)
    waiting = clipped((cls == "communication") & main & inside)
    compute = subtract(clipped((cls == "compute") & main & is_op & inside), waiting)
    parts = [
        compute,
        clipped((cls == "data") & cpu & inside),
        clipped((cls == "optimizer") & cpu & inside),
    ]
    busy = union(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    starts, ends = subtract(comm, busy)
    return float((ends - starts).sum()) / 1e3


def test_04_1_exposed_communication(capsys):
    checks.check_exposed_communication(exposed_communication_ms)
    assert "✓ exercise 04.1" in capsys.readouterr().out


def test_04_1_typical_mistakes():
    def all_communication(trace, k):
        _, s0, s1 = trace.steps[k]
        cls = np.array([classify_name(n) or "" for n in trace.names], dtype=object)
        m = (cls[trace.name_id] == "communication") & (trace.end > s0) & (trace.start < s1)
        s, e = union(np.clip(trace.start[m], s0, s1), np.clip(trace.end[m], s0, s1))
        return float((e - s).sum()) / 1e3

    def waiting_counts_as_compute(trace, k):  # forgets to take the c10d:: wait out of compute
        _, s0, s1 = trace.steps[k]
        cls = np.array([classify_name(n) or "" for n in trace.names], dtype=object)[trace.name_id]
        inside = (trace.end > s0) & (trace.start < s1)
        main = trace.lane == trace.main_lane

        def clipped(mask):
            return union(np.clip(trace.start[mask], s0, s1), np.clip(trace.end[mask], s0, s1))

        comm = clipped((cls == "communication") & inside)
        busy = clipped(
            ((cls == "compute") & main | (cls == "data") | (cls == "optimizer")) & inside
        )
        starts, ends = subtract(comm, busy)
        return float((ends - starts).sum()) / 1e3

    fails(checks.check_exposed_communication, all_communication, "all of the communication")
    fails(checks.check_exposed_communication, waiting_counts_as_compute, "too little")


def test_04_1_the_course_breakdown_is_refused():
    from course_utils.profiling import analysis

    def asks_analyse_trace(trace, k):
        return analysis.analyse_trace(trace)[k].communication

    def asks_analyse(trace, k):
        a = analysis.analyse({0: trace})
        return a.steps[k].communication

    def asks_by_imported_name(trace, k):
        from course_utils.profiling.analysis import analyse_trace

        return analyse_trace(trace)[k].communication

    source = inspect.getsource(analysis.analyse_trace).replace("def analyse_trace", "def mine")
    namespace = dict(vars(analysis))
    exec(compile(source, "<a notebook cell>", "exec"), namespace)  # pasted from the package
    pasted = namespace["mine"]
    assert pasted.__code__ is not analysis.analyse_trace.__code__

    def via_pasted(trace, k):  # the package's code pasted into a helper of the student's
        return pasted(trace)[k].communication

    def in_a_thread(trace, k):  # the refusal swaps the function's code: every thread sees it
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asks_analyse_trace, trace, k).result()

    for answer in (asks_analyse_trace, asks_analyse, asks_by_imported_name, in_a_thread):
        fails(checks.check_exposed_communication, answer, "analyse / analyse_trace")
    # a copy of the package's code pasted into a cell is not policed: it is the student's code now,
    # judged by what it computes (the checks refuse calls, not copies)
    checks.check_exposed_communication(via_pasted)


# ---- 04.2 bus bandwidth -----------------------------------------------------------------------

FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_bandwidth(op, nbytes, seconds, n):
    return nbytes / seconds / 1e9 * FACTORS[op](n)


def test_04_2_bus_bandwidth(capsys):
    checks.check_bus_bandwidth(bus_bandwidth)
    assert "✓ exercise 04.2" in capsys.readouterr().out


def test_04_2_typical_mistakes():
    def algorithm_bandwidth(op, nbytes, seconds, n):
        return nbytes / seconds / 1e9

    def all_reduce_like_the_others(op, nbytes, seconds, n):
        return nbytes / seconds / 1e9 * (1.0 if op == "broadcast" else (n - 1) / n)

    first = 1.048576 * 2 * (2 - 1) / 2  # all_reduce, 1 MiB in 1 ms on 2 ranks, in GB/s
    absent = [f"{first:.3g}", "2(n-1)/n", "2 (n - 1) / n"]
    fails(checks.check_bus_bandwidth, algorithm_bandwidth, "algorithm bandwidth", absent)
    fails(checks.check_bus_bandwidth, all_reduce_like_the_others, "send or receive", absent)


def test_04_2_looking_the_factor_up_is_refused():
    def looked_up(op, nbytes, seconds, n):  # collectives is imported in notebook 04
        return nbytes / seconds / 1e9 * collectives.bus_factor(op, n)

    original = collectives.bus_factor
    fails(checks.check_bus_bandwidth, looked_up, "work out each collective's factor yourself")
    assert collectives.bus_factor is original and collectives.bus_factor("broadcast", 4) == 1.0


# ---- 05.1 1F1B order --------------------------------------------------------------------------


def one_f_one_b(p, m):
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [("F", warm + i), ("B", i)]
        acts += [("B", i) for i in range(m - warm, m)]
        orders.append(acts)
    return orders


def test_05_1_one_f_one_b(capsys):
    checks.check_one_f_one_b(one_f_one_b)
    assert "✓ exercise 05.1" in capsys.readouterr().out


def test_05_1_typical_mistakes():
    def gpipe(p, m):
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]

    def one_backward_short(p, m):
        return [acts[:-1] for acts in one_f_one_b(p, m)]

    fails(checks.check_one_f_one_b, gpipe, "forwards before its first backward", ["('B', 0)", "[("])
    fails(checks.check_one_f_one_b, one_backward_short, "exactly one F and one B", ["[("])


def test_05_1_asking_the_simulator_is_refused():
    def from_order(p, m):  # schedule_order imported by name, as a notebook could
        return [[(a.kind, a.micro) for a in acts] for acts in schedule_order("1f1b", p, m, 1)]

    def from_simulate(p, m):
        return [[(a.kind, a.micro) for a in acts] for acts in simulate("1f1b", p, m).order]

    assert from_order(3, 5) == one_f_one_b(3, 5)  # both would pass without the guard
    for answer in (from_order, from_simulate):
        fails(checks.check_one_f_one_b, answer, "asked the simulator")
    # restored afterwards, here and in the package
    simulate_module = importlib.import_module("course_utils.pipeline.simulate")
    assert globals()["schedule_order"] is simulate_module.schedule_order
    assert from_simulate(3, 5) == from_order(3, 5) == one_f_one_b(3, 5)


def test_05_1_hints_do_not_state_the_rule():
    def gpipe(p, m):
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]

    message = fails(checks.check_one_f_one_b, gpipe, "forwards before its first backward")
    assert "p - s - 1" not in message and "p-s-1" not in message


# ---- 05.2 balanced stages ---------------------------------------------------------------------


def balanced_split(costs, p):
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds, j = [], n
    for k in range(p, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    return bounds[::-1]


def test_05_2_balanced_split(capsys):
    checks.check_balanced_split(balanced_split)
    assert "✓ exercise 05.2" in capsys.readouterr().out


def test_05_2_typical_mistakes():
    def equal_layer_counts(costs, p):  # as many layers per stage, whatever they cost
        edges = [round(i * len(costs) / p) for i in range(p + 1)]
        return list(zip(edges, edges[1:]))

    def overlapping(costs, p):
        return [(a, b + 1 if b < len(costs) else b) for a, b in balanced_split(costs, p)]

    best = reference_split([8, 1, 1, 1, 1, 1, 1, 1, 1], 2)
    fails(checks.check_balanced_split, equal_layer_counts, "a split exists", [best])
    fails(checks.check_balanced_split, overlapping, "where the previous one ends")


def test_05_2_the_package_split_is_refused():
    from course_utils.pipeline import partition as partition_module

    def asks_the_package(costs, p):
        return reference_split(costs, p)

    def through_partition(costs, p):  # partition() balances with the package's split inside
        model = nn.Sequential(*[nn.Linear(1, 1) for _ in costs])
        return partition_module.partition(model, p)

    source = inspect.getsource(partition_module.balanced_split)
    namespace = dict(vars(partition_module))
    exec(compile(source.replace("def balanced_split", "def mine"), "<a cell>", "exec"), namespace)
    pasted = namespace["mine"]

    def via_pasted(costs, p):
        return pasted(costs, p)

    def in_a_thread(costs, p):
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(reference_split, costs, p).result()

    for answer in (reference_split, asks_the_package, through_partition, in_a_thread):
        fails(checks.check_balanced_split, answer, "the package's own balanced_split")
    assert partition_module.balanced_split is reference_split  # restored, code included
    assert reference_split([1, 1], 2) == [(0, 1), (1, 2)]
    checks.check_balanced_split(via_pasted)  # copies are not policed: judged by what they compute


# ---- 05.3 the mailbox -------------------------------------------------------------------------


class Mailbox:  # the model answer, written apart from the package's
    def __init__(self, group=None):
        self.group = group
        self.waiting = []  # (tensor, dst) not posted yet
        self.posted = []  # work handles of sends posted without a receive

    def send(self, tensor, dst):
        self.waiting.append((tensor.detach().contiguous(), dst))

    def _ops(self):
        ops = [dist.P2POp(dist.isend, t, dst, self.group) for t, dst in self.waiting]
        self.waiting = []
        return ops

    def recv(self, shape, dtype, device, src):
        buf = torch.empty(shape, dtype=dtype, device=device)
        ops = self._ops() + [dist.P2POp(dist.irecv, buf, src, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return buf

    def flush(self):
        ops = self._ops()
        if ops:
            self.posted += dist.batch_isend_irecv(ops)

    def wait_all(self):
        self.flush()
        for work in self.posted:
            work.wait()
        self.posted = []


class SendsAtOnce(Mailbox):  # every send leaves immediately, on its own
    def send(self, tensor, dst):
        self.posted.append(dist.isend(tensor.detach().contiguous(), dst, self.group))


class SendsBeforeTheReceive(Mailbox):  # the waiting sends in a batch of their own, then the receive
    def recv(self, shape, dtype, device, src):
        self.flush()
        buf = torch.empty(shape, dtype=dtype, device=device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, src, self.group)]):
            work.wait()
        return buf


class ForgetsWhatWaits(Mailbox):  # wait_all waits for what was posted, never posts the rest
    def wait_all(self):
        for work in self.posted:
            work.wait()
        self.posted = []


class DelegatingMailbox:  # the package's mailbox inside
    def __init__(self, group=None):
        from course_utils.pipeline.p2p import Mailbox as PackageMailbox

        self.inner = PackageMailbox(group)

    def send(self, tensor, dst):
        self.inner.send(tensor, dst)

    def recv(self, shape, dtype, device, src):
        return self.inner.recv(shape, dtype, device, src)

    def flush(self):
        self.inner.flush()

    def wait_all(self):
        self.inner.wait_all()


@pytest.mark.multiprocess
def test_05_3_mailbox(runs_root, capsys):
    checks.check_mailbox(Mailbox)
    assert "✓ exercise 05.3" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_05_3_typical_mistakes(runs_root):
    fails(checks.check_mailbox, SendsAtOnce, "on its own")
    fails(checks.check_mailbox, SendsBeforeTheReceive, "in the receive's own batch")
    fails(checks.check_mailbox, ForgetsWhatWaits, "never posted")


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_05_3_the_package_mailbox_is_refused(runs_root):
    from course_utils.pipeline import p2p

    class Subclass(p2p.Mailbox):
        pass

    for answer in (p2p.Mailbox, Subclass, DelegatingMailbox):
        fails(checks.check_mailbox, answer, "the package's own Mailbox")


# ---- 08.1 the padding arithmetic, 08.2 stage 1's step -----------------------------------------


def shard_bounds(numel, n, rank):
    shard = -(-numel // n)
    return rank * shard, (rank + 1) * shard, shard * n - numel


def coords(rank, dp, pp, tp):
    return rank // tp % dp, rank // (tp * dp), rank % tp


def links(dp, pp, tp, gpus_per_node):
    from course_utils.topology import ParallelDims

    d = ParallelDims(dp, pp, tp)
    return {
        dim: "intra"
        if all(len({r // gpus_per_node for r in g}) == 1 for g in d.group_ranks(dim))
        else "inter"
        for dim in ("tp", "pp", "dp")
    }


def test_07_1_coords_and_07_2_links(capsys):
    checks.check_coords(coords)
    checks.check_links(links)
    out = capsys.readouterr().out
    assert "✓ exercise 07.1" in out and "✓ exercise 07.2" in out


def test_07_typical_mistakes():
    def pp_inside_dp(rank, dp, pp, tp):  # DP outermost: Megatron's order has PP outermost
        return rank // (tp * pp), rank // tp % pp, rank % tp

    def tp_outermost(rank, dp, pp, tp):
        return rank % dp, rank // dp % pp, rank // (dp * pp)

    def via_package(rank, dp, pp, tp):
        from course_utils.topology import ParallelDims

        return tuple(ParallelDims(dp, pp, tp).coords(rank))

    def by_world_size(dp, pp, tp, g):  # the whole run fits in a node, else everything crosses
        return {d: "intra" if dp * pp * tp <= g else "inter" for d in ("tp", "pp", "dp")}

    def ignores_boundaries(dp, pp, tp, g):  # a group smaller than a node may still straddle two
        span = {"tp": tp, "dp": dp * tp if dp > 1 else 1, "pp": dp * pp * tp if pp > 1 else 1}
        return {d: "intra" if span[d] <= g else "inter" for d in span}

    fails(checks.check_coords, pp_inside_dp, "DP comes before PP")
    fails(checks.check_coords, tp_outermost, "TP is the innermost")
    fails(checks.check_coords, via_package, "without ParallelDims.coords")
    fails(checks.check_links, by_world_size, "lies inside one node")
    fails(checks.check_links, ignores_boundaries, "spans more than one node")


def test_07_2_the_planner_is_refused():
    from course_utils.plan import Choice, placement

    def via_planner(dp, pp, tp, g):
        return placement(Choice(dp, pp, tp), g)

    def via_module(dp, pp, tp, g):
        from course_utils.plan import layouts

        return dict(layouts._placement(dp, pp, tp, g))

    for answer in (via_planner, via_module):
        fails(checks.check_links, answer, "the planner's own answer")


def build_groups(dp, pp, tp):  # the model answer: every group of every dimension, in one order
    n, me = dist.get_world_size(), dist.get_rank()
    out = {}
    for dim in ("tp", "pp", "dp"):
        found = {}
        for r in range(n):
            c = {"tp": r % tp, "dp": r // tp % dp, "pp": r // (tp * dp)}
            found.setdefault(tuple(v for d, v in c.items() if d != dim), []).append(r)
        lists = sorted(found.values())
        group, _ = dist.new_subgroups_by_enumeration(lists)
        out[dim] = (group, next(g for g in lists if me in g))
    return out


def groups_swapped(dp, pp, tp):  # the DP and PP groups exchanged
    out = build_groups(dp, pp, tp)
    out["dp"], out["pp"] = out["pp"], out["dp"]
    return out


def groups_listed_not_made(dp, pp, tp):  # the right ranks, but every group is the whole world
    out = build_groups(dp, pp, tp)
    return {d: (None, ranks) for d, (_, ranks) in out.items()}


def groups_from_the_package(dp, pp, tp):
    from course_utils.topology import ParallelDims

    g = ParallelDims(dp, pp, tp).build()
    return {d: (g.group(d), g.ranks[d]) for d in ("tp", "pp", "dp")}


@pytest.mark.multiprocess
def test_07_3_groups(runs_root, capsys):
    checks.check_groups(build_groups)
    assert "✓ exercise 07.3" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_07_3_typical_mistakes_and_bypasses(runs_root):
    fails(checks.check_groups, groups_swapped, "differ from")
    fails(checks.check_groups, groups_listed_not_made, "is not the ranks you listed")
    fails(checks.check_groups, groups_from_the_package, "builds the grid for you")


def test_08_1_shard_bounds(capsys):
    checks.check_shard_bounds(shard_bounds)
    assert "✓ exercise 08.1" in capsys.readouterr().out


def test_08_1_typical_mistakes():
    def floor_division(numel, n, rank):  # drops the remainder: the shards miss numbers
        s = numel // n
        return rank * s, (rank + 1) * s, 0

    def padding_per_rank(numel, n, rank):
        s = -(-numel // n)
        return rank * s, (rank + 1) * s, s - numel // n

    fails(checks.check_shard_bounds, floor_division, "round up")
    fails(checks.check_shard_bounds, padding_per_rank, "the padded buffer is n shards long")


def via_package(numel, n, rank):
    from course_utils.zero import flat

    s = flat.padded_numel(numel, n) // n
    return rank * s, (rank + 1) * s, flat.padded_numel(numel, n) - numel


def test_08_1_the_package_is_refused():
    fails(checks.check_shard_bounds, via_package, "without course_utils.zero.flat")


def zero1_step(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad, flat_grads)
    shard.grad = grad / dist.get_world_size()
    optimizer.step()
    dist.all_gather_into_tensor(flat_params, shard.detach().clone())


def zero1_sum(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad, flat_grads)
    shard.grad = grad  # the sum, not the mean
    optimizer.step()
    dist.all_gather_into_tensor(flat_params, shard.detach().clone())


def zero1_all_reduce(flat_params, flat_grads, shard, optimizer):
    n, r = dist.get_world_size(), dist.get_rank()
    dist.all_reduce(flat_grads)
    s = flat_grads.numel() // n
    shard.grad = flat_grads[r * s : (r + 1) * s] / n
    optimizer.step()
    dist.all_gather_into_tensor(flat_params, shard.detach().clone())


def zero1_no_gather(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad, flat_grads)
    shard.grad = grad / dist.get_world_size()
    optimizer.step()


@pytest.mark.multiprocess
def test_08_2_zero1_step(runs_root, capsys):
    checks.check_zero1_step(zero1_step)
    assert "✓ exercise 08.2" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_08_2_typical_mistakes(runs_root):
    fails(checks.check_zero1_step, zero1_sum, "did you divide by n", ["tensor("])
    fails(checks.check_zero1_step, zero1_all_reduce, "though it updates only its shard")
    fails(checks.check_zero1_step, zero1_no_gather, "updated shard must reach every rank once")


# ---- 08.3 stage 3 -----------------------------------------------------------------------------


class Zero3:  # the model answer (the notebook's, with the exercise's methods filled in)
    def __init__(self, model, optimizer_class, options):
        from course_utils.zero.flat import Bucket

        self.n, r = dist.get_world_size(), dist.get_rank()
        self.model, self.units = model, []
        layers = [
            m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        for layer in layers:
            params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
            bucket = Bucket.of(params, self.n)
            flat = bucket.flatten([p.detach() for p in params])
            lo, hi = bucket.shard_range(r)
            unit = {"bucket": bucket, "flat": flat, "shard": nn.Parameter(flat[lo:hi].clone())}
            unit["arrived"] = 0
            for p, view in zip(params, bucket.views(flat)):
                p.data = view
            self.free(unit)
            self.units.append(unit)
            layer.register_forward_pre_hook(lambda m, args, u=unit: self.gather(u))
            layer.register_forward_hook(lambda m, args, out, u=unit: self.after_forward(u, out))
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self.arrived(u))
        self.optimizer = optimizer_class([u["shard"] for u in self.units], **options)

    def gather(self, u):
        flat = u["flat"]
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            dist.all_gather_into_tensor(flat, u["shard"].detach())

    def free(self, u):
        u["flat"].untyped_storage().resize_(0)

    def after_forward(self, u, out):
        self.free(u)
        if out.requires_grad:
            out.register_hook(lambda grad: self.gather(u))

    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            out = torch.empty(bucket.shard_numel, dtype=grads.dtype, device=grads.device)
            dist.reduce_scatter_tensor(out, grads)
            u["shard"].grad = out / self.n
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0
            self.free(u)

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()

    def full_parameters(self):
        out = {}
        for u in self.units:
            self.gather(u)
            for p in u["bucket"].params:
                out[id(p)] = p.detach().clone()
            self.free(u)
        return {name: out.get(id(p), p.detach()) for name, p in self.model.named_parameters()}


class Zero3KeepsEverything(Zero3):  # gathers once, never frees after forward or backward
    def after_forward(self, u, out):
        pass

    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            out = torch.empty(bucket.shard_numel, dtype=grads.dtype, device=grads.device)
            dist.reduce_scatter_tensor(out, grads)
            u["shard"].grad = out / self.n
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0


class Zero3AllReduce(Zero3):  # all-reduces the full gradients, then keeps its shard
    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            dist.all_reduce(grads)
            lo, hi = bucket.shard_range(dist.get_rank())
            u["shard"].grad = grads[lo:hi] / self.n
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0
            self.free(u)


class Zero3Sum(Zero3):  # the sum of the gradients, not the mean
    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            out = torch.empty(bucket.shard_numel, dtype=grads.dtype, device=grads.device)
            dist.reduce_scatter_tensor(out, grads)
            u["shard"].grad = out
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0
            self.free(u)


class Zero3FromThePackage:
    def __init__(self, model, optimizer_class, options):
        from course_utils.zero import ShardedModel

        self.sharded = ShardedModel(model)
        self.optimizer = optimizer_class(self.sharded.parameters(), **options)

    def step(self):
        self.sharded.finish_gradient_synchronization()
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()

    def full_parameters(self):
        return self.sharded.full_parameters()


@pytest.mark.multiprocess
def test_08_3_zero3(runs_root, capsys):
    checks.check_zero3(Zero3)
    assert "✓ exercise 08.3" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_08_3_typical_mistakes_and_bypasses(runs_root):
    fails(checks.check_zero3, Zero3KeepsEverything, "free each unit")
    fails(checks.check_zero3, Zero3AllReduce, "needs no all-reduce")
    fails(checks.check_zero3, Zero3Sum, "divided by n")
    fails(checks.check_zero3, Zero3FromThePackage, "package's own stage 3")


# ---- the checks' own references and case lists -----------------------------------------------


# ---- the row-parallel forward (06.1 before f and g replaced it; still public) ---------------


def row_parallel_linear(x_shard, weight_shard, bias):
    out = torch.nn.functional.linear(x_shard, weight_shard)
    dist.all_reduce(out)
    return out if bias is None else out + bias


def row_bias_on_every_rank(x_shard, weight_shard, bias):
    out = torch.nn.functional.linear(x_shard, weight_shard, bias)
    dist.all_reduce(out)
    return out


def test_check_row_parallel_linear(capsys):
    checks.check_row_parallel_linear(row_parallel_linear)
    assert "✓ exercise 06 (row-parallel forward)" in capsys.readouterr().out
    fails(checks.check_row_parallel_linear, row_bias_on_every_rank, "the bias arrived t times")


# ---- 06.1 f and g, 06.2 the head split, 06.3 the vocabulary-parallel loss ----------------------


class CopyToTP(torch.autograd.Function):  # the model answers, written apart from the package's
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceInPlace(torch.autograd.Function):  # forgets the copy
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceBothWays(torch.autograd.Function):  # all-reduces the gradient too
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class CopyThatReduces(torch.autograd.Function):  # f with g's forward
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.multiprocess
def test_06_1_f_and_g(runs_root, capsys):
    checks.check_f_and_g(CopyToTP, ReduceFromTP)
    assert "✓ exercise 06.1" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_06_1_typical_mistakes_and_bypasses(runs_root):
    from course_utils.tensor_parallel import comm

    fails(functools.partial(checks.check_f_and_g, CopyToTP), ReduceInPlace, "in place")
    fails(functools.partial(checks.check_f_and_g, CopyToTP), ReduceBothWays, "g's backward")
    fails(lambda c: checks.check_f_and_g(c, ReduceFromTP), CopyThatReduces, "f's forward")
    fails(lambda c: checks.check_f_and_g(c, comm._ReduceFromTP), CopyToTP, "package's own f / g")

    class Wrapping(torch.autograd.Function):  # the package's f called inside
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return comm._CopyToTP.backward(ctx, grad)[0]

    fails(lambda c: checks.check_f_and_g(c, ReduceFromTP), Wrapping, "package's own f / g")


def qkv_shard(wq, wk, wv, bq, bk, bv, rank, t, head_dim):
    h = wq.shape[1]
    a = wq.shape[0] // head_dim
    w = torch.stack([m.view(a, head_dim, h) for m in (wq, wk, wv)], dim=1)
    b = torch.stack([v.view(a, head_dim) for v in (bq, bk, bv)], dim=1)
    mine = slice(rank * a // t, (rank + 1) * a // t)
    return w[mine].reshape(-1, h), b[mine].reshape(-1)


def test_06_2_qkv_shard_and_mistakes(capsys):
    checks.check_qkv_shard(qkv_shard)
    assert "✓ exercise 06.2" in capsys.readouterr().out

    def gpt2_layout(wq, wk, wv, bq, bk, bv, rank, t, head_dim):  # [Q | K | V], cut contiguously
        w, b = torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv])
        n = w.shape[0] // t
        return w[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n]

    def q_then_k_then_v(wq, wk, wv, bq, bk, bv, rank, t, head_dim):  # the right rows, not by head
        rows = slice(rank * wq.shape[0] // t, (rank + 1) * wq.shape[0] // t)
        return torch.cat([wq[rows], wk[rows], wv[rows]]), torch.cat([bq[rows], bk[rows], bv[rows]])

    fails(checks.check_qkv_shard, gpt2_layout, "heads")
    fails(checks.check_qkv_shard, q_then_k_then_v, "wrong order")


class VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):  # (N, V/t), (N,)
        start = dist.get_rank() * logits.shape[-1]
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top[:, None]
        e = shifted.exp()
        mine = (target >= start) & (target < start + logits.shape[-1])
        idx = (target - start).clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, idx[:, None])[:, 0] * mine
        both = torch.stack([e.sum(-1), picked])
        dist.all_reduce(both)
        ctx.save_for_backward(e / both[0][:, None], idx, mine)
        return both[0].log() - both[1]

    @staticmethod
    def backward(ctx, grad):
        p, idx, mine = ctx.saved_tensors
        g = p.clone()
        g[torch.arange(len(idx)), idx] -= mine.to(g.dtype)
        return g * grad[:, None], None


class GathersTheLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, logits)
        return nn.functional.cross_entropy(torch.cat(parts, -1), target, reduction="none")

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not reached")


class NoMaxShift(VocabParallelCE):  # overflows in float32 with large logits
    @staticmethod
    def forward(ctx, logits, target):
        start = dist.get_rank() * logits.shape[-1]
        e = logits.exp()
        mine = (target >= start) & (target < start + logits.shape[-1])
        idx = (target - start).clamp(0, logits.shape[-1] - 1)
        picked = logits.gather(-1, idx[:, None])[:, 0] * mine
        both = torch.stack([e.sum(-1), picked])
        dist.all_reduce(both)
        ctx.save_for_backward(e / both[0][:, None], idx, mine)
        return both[0].log() - both[1]


class EveryRankItsTarget(VocabParallelCE):  # the target's logit taken on every rank
    @staticmethod
    def forward(ctx, logits, target):
        start = dist.get_rank() * logits.shape[-1]
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top[:, None]
        e = shifted.exp()
        idx = (target - start).clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, idx[:, None])[:, 0]
        both = torch.stack([e.sum(-1), picked])
        dist.all_reduce(both)
        ctx.save_for_backward(e / both[0][:, None], idx, torch.ones_like(target, dtype=torch.bool))
        return both[0].log() - both[1]


class ReducesInBackward(VocabParallelCE):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return VocabParallelCE.backward(ctx, grad / dist.get_world_size())


@pytest.mark.multiprocess
def test_06_3_vocab_parallel_cross_entropy(runs_root, capsys):
    checks.check_vocab_parallel_cross_entropy(VocabParallelCE)
    assert "✓ exercise 06.3" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_06_3_typical_mistakes_and_bypasses(runs_root):
    from course_utils.tensor_parallel import loss

    check = checks.check_vocab_parallel_cross_entropy
    fails(check, GathersTheLogits, "all-reduces only")
    fails(check, NoMaxShift, "overflows")
    fails(check, EveryRankItsTarget, "one rank only")
    fails(check, ReducesInBackward, "backward communicated")
    fails(check, loss._VocabParallelCrossEntropy, "package's own")

    class ThroughThePackage(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            return loss.vocab_parallel_cross_entropy(logits[:, None], target[:, None]).expand(
                len(target)
            )

        @staticmethod
        def backward(ctx, grad):
            return None, None

    fails(check, ThroughThePackage, "package's own")

    class LossParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = init_device_mesh(logits.device.type, (dist.get_world_size(),))
            d = DTensor.from_local(logits, mesh, [Shard(1)])
            return nn.functional.cross_entropy(d, target, reduction="none").to_local()

        @staticmethod
        def backward(ctx, grad):
            return None, None

    fails(check, LossParallel, "loss_parallel")


def _textbook_attention(x, wq, wk, wv, bq, bk, bv, wo, bo, a):
    """Multi-head causal attention from separate Q, K, V matrices whose rows go head by head:
    written here without the course's model or its fused layout."""
    B, T, h = x.shape
    hd = h // a

    def heads(w, b):
        return (x @ w.T + b).view(B, T, a, hd).transpose(1, 2)  # (B, a, T, hd)

    q, k, v = heads(wq, bq), heads(wk, bk), heads(wv, bv)
    scores = (q @ k.transpose(-2, -1)) / hd**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, h)
    return y @ wo.T + bo


@pytest.mark.parametrize("a, t, hd", [(4, 2, 3), (8, 4, 2), (6, 3, 4), (2, 2, 8)])
def test_06_2_reference_runs_the_course_model_as_textbook_attention(a, t, hd):
    """Check 06.2's reference shards, loaded into the course's attention layer on each of t
    "ranks" (row-parallel proj, its bias added once), must compute what textbook attention with the
    separate matrices computes. A reference with the wrong layout would agree with a wrong answer."""
    from course_utils.checks.nb06 import _reference_shard
    from course_utils.models import CausalSelfAttention, GPTConfig

    h = a * hd
    g = torch.Generator().manual_seed(a + 10 * t)
    wq, wk, wv, wo = (torch.randn(h, h, generator=g, dtype=torch.float64) for _ in range(4))
    bq, bk, bv, bo = (torch.randn(h, generator=g, dtype=torch.float64) for _ in range(4))
    x = torch.randn(2, 5, h, generator=g, dtype=torch.float64)
    want = _textbook_attention(x, wq, wk, wv, bq, bk, bv, wo, bo, a)
    cfg = GPTConfig(vocab=8, seq_len=5, d_model=h, n_heads=a, n_layers=1, dropout=0.0)
    total = torch.zeros_like(want)
    for rank in range(t):
        layer = CausalSelfAttention(cfg).double()
        w, b = _reference_shard(wq, wk, wv, bq, bk, bv, rank, t, hd)
        layer.qkv = nn.Linear(h, 3 * h // t).double()
        layer.proj = nn.Linear(h // t, h, bias=False).double()
        with torch.no_grad():
            layer.qkv.weight.copy_(w)
            layer.qkv.bias.copy_(b)
            layer.proj.weight.copy_(wo[:, rank * h // t : (rank + 1) * h // t])  # row parallel
        total += layer(x).detach()
    torch.testing.assert_close(total + bo, want, rtol=1e-12, atol=1e-12)


class _Spy:
    """A right answer that also writes down what the check asked it: the cases the check covers."""

    def __init__(self, answer, log):
        self.answer, self.log = answer, str(log)

    def __call__(self, *args):
        import json

        world = dist.get_world_size() if dist.is_initialized() else None
        seen = [list(a.shape) if torch.is_tensor(a) else a for a in args[:3]]
        with open(self.log, "a") as f:
            f.write(json.dumps([*seen, world]) + "\n")
        return self.answer(*args)


def _asked(log) -> list:
    import json

    return [json.loads(line) for line in log.read_text().splitlines()]


def test_08_1_cases_cover_what_the_docstring_promises(tmp_path):
    """08.1 promises uneven splits, fewer elements than ranks and one rank: its cases include them."""
    log = tmp_path / "asked.jsonl"
    checks.check_shard_bounds(_Spy(shard_bounds, log))
    asked = [(numel, n) for numel, n, _rank, _world in _asked(log)]
    assert any(numel % n for numel, n in asked)  # padding needed
    assert any(numel < n for numel, n in asked)  # ranks left with padding only
    assert any(n == 1 for _, n in asked) and any(numel % n == 0 for numel, n in asked)


@pytest.mark.multiprocess
def test_08_2_still_tries_an_uneven_padded_split_on_3_ranks(runs_root, tmp_path):
    """ToyMLP's 1732 parameters do not split over 3 ranks: the flat buffer is padded to 1734. An
    answer that only works without padding must meet that case."""
    from course_utils.models import ToyMLP

    psi = sum(p.numel() for p in ToyMLP().parameters())
    log = tmp_path / "asked.jsonl"
    checks.check_zero1_step(_Spy(zero1_step, log))
    asked = {(tuple(flat), world) for flat, _grads, _shard, world in _asked(log)}
    assert ((psi + (-psi) % 3,), 3) in asked and psi % 3, asked  # padded on 3 ranks
    assert any(world == 2 for _, world in asked)
