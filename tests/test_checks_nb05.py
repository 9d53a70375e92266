"""Notebook 05's exercise checks (05.1 1F1B order, 05.2 balanced stages, 05.3 the mailbox on real
gloo ranks): a right answer passes; typical wrong ones and the package's get the hint.
"""

from __future__ import annotations

import importlib
import inspect
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils import checks
from course_utils.pipeline.partition import balanced_split as reference_split
from course_utils.pipeline.simulate import schedule_order, simulate
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


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
