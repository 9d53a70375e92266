"""Notebook 02's exercise checks (02.1 the DataParallel step, 02.2 without the gather): a right
answer passes; typical wrong ones and bypasses get the hint, never the answer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from course_utils import checks
from course_utils.checks import nb02
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- 02.1 the DataParallel step, 02.2 without the gather ---------------------------------------


def fails_in_turn(check, answer, hint: str) -> str:
    """``fails`` for an answer whose replicas never meet at the check's barrier (they run one after
    another in one thread, or only one forward runs): the barrier's wait then decides only how long
    it takes to break, so it is cut from 10 s to 0.5 s."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nb02, "REPLICA_WAIT_S", 0.5)
        return fails(check, answer, hint)


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
    fails_in_turn(checks.check_data_parallel_step, with_(threads=False), "a thread of its own")


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
    fails_in_turn(checks.check_data_parallel_step, one_device, "scatter the batch")
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

    fails_in_turn(checks.check_data_parallel_step, decoys, "forward ran on batches of")
    fails(checks.check_data_parallel_step, shallow, "shallow copy shares them")
    fails_in_turn(checks.check_data_parallel_step, one_worker, "did not run at the same time")
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
