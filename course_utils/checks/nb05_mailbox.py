"""Exercise 05.3 inside a rank: the student's mailbox in the course's pipeline runtime, with every
point-to-point operation watched.

What is watched, and why:
- every ``send``/``recv`` op the dispatcher sees must come from inside ``batch_isend_irecv``: a
  send issued on its own (``dist.send``, ``dist.isend``) blocks on NCCL until the neighbour posts
  its receive, and the neighbour is doing the same: deadlock;
- a ``recv`` posts, in the same batch as its receive, every send queued since the last post: a
  separate batch of sends before the receive is two groups in NCCL's order, the same deadlock;
- ``flush`` posts every queued send, with no receive;
- when ``wait_all`` returns, every send has completed.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..comm.counting import CommunicationMode
from ..measure import worst as worst_of
from ..models import pipeline_mlp
from ..pipeline import p2p
from ..pipeline.parity import pipeline_worker
from .common import fail, refuse_calls

ALONE = (
    "a {op} went out on its own, outside batch_isend_irecv: on NCCL it blocks until the "
    "neighbour posts the matching operation, and in 1F1B the neighbour is blocked in its own "
    "send. Post sends and the receive together: dist.batch_isend_irecv([P2POp(...), ...])"
)


PACKAGE_MAILBOX = (
    "that is the package's own Mailbox (course_utils.pipeline.p2p), which the check compares "
    "with: write the pairing of sends and receives yourself"
)


@contextlib.contextmanager
def refusing_package_mailbox(mailbox_cls):
    """While a rank runs the student's mailbox, the package's Mailbox (by name, subclassed or
    delegated to) refuses."""
    with refuse_calls("05.3", [p2p.Mailbox], PACKAGE_MAILBOX):
        yield


class _Watch(CommunicationMode):
    """Refuses point-to-point ops issued outside a batch, and any collective."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def before(self, call) -> None:
        if call.namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
            return
        if call.name in ("send", "recv_", "recv_any_source_"):
            if not self.state["in_batch"]:
                fail("05.3", ALONE.format(op="send" if call.name == "send" else "receive"))
        elif call.name not in ("barrier",):
            fail("05.3", f"a mailbox moves data point to point; {call.name} is a collective")


class _Work:
    """A work handle that remembers whether it was waited on."""

    def __init__(self, work, sends: int, state):
        self.work, self.sends, self.state, self.waited = work, sends, state, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _batching(state):
    real = c10d.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        ops = list(p2p_op_list)
        sends = sum(1 for op in ops if op.op in (dist.isend, c10d.isend))
        recvs = len(ops) - sends
        state["batches"].append((sends, recvs))
        state["in_batch"] = True
        try:
            works = real(ops)
        finally:
            state["in_batch"] = False
        wrapped = [_Work(w, sends, state) for w in works]
        state["works"] += wrapped
        return wrapped

    return real, batch_isend_irecv


class _Watched:
    """The student's mailbox, with its contract checked at every call."""

    def __init__(self, inner, state, rank):
        self.inner, self.state, self.rank = inner, state, rank
        self.queued = 0

    def send(self, tensor, dst):
        self.queued += 1
        return self.inner.send(tensor, dst)

    def _posted_since(self, mark):
        return self.state["batches"][mark:]

    def recv(self, shape, dtype, device, src):
        mark = len(self.state["batches"])
        buf = self.inner.recv(shape, dtype, device, src)
        batches = self._posted_since(mark)
        with_recv = [b for b in batches if b[1] > 0]
        if len(with_recv) != 1 or with_recv[0][1] != 1:
            fail("05.3", f"rank {self.rank}: recv() must post its receive in one "
                 f"batch_isend_irecv (batches posted: {batches}, as (sends, receives))")  # fmt: skip
        if with_recv[0][0] != self.queued or len(batches) != 1:
            fail("05.3", f"rank {self.rank}: {self.queued} send(s) waited in the mailbox when "
                 f"recv() was called, and the receive's batch carried {with_recv[0][0]} of them "
                 f"(batches posted: {batches}, as (sends, receives)). Every waiting send must "
                 "leave in the receive's own batch: a batch of sends alone, before it, can "
                 "deadlock with a neighbour doing the same")  # fmt: skip
        if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            fail("05.3", f"rank {self.rank}: recv() returned {tuple(buf.shape)} {buf.dtype}, "
                 f"asked for {tuple(shape)} {dtype}")  # fmt: skip
        self.queued = 0
        return buf

    def flush(self):
        mark, posted = len(self.state["batches"]), len(self.state["works"])
        self.inner.flush()
        if any(w.waited for w in self.state["works"][posted:]):
            fail("05.3", f"rank {self.rank}: flush() waited for the sends it posted: it posts them "
                 "and returns, so that the stage goes on computing while they travel (a send "
                 "waited at once stalls until the neighbour receives it); wait_all() waits")  # fmt: skip
        batches = self._posted_since(mark)
        sent = sum(b[0] for b in batches)
        if any(b[1] for b in batches) or sent != self.queued:
            fail("05.3", f"rank {self.rank}: flush() must post the {self.queued} waiting send(s) "
                 f"and nothing else; it posted {batches} (sends, receives)")  # fmt: skip
        self.queued = 0

    def wait_all(self):
        mark = len(self.state["batches"])
        self.inner.wait_all()
        batches = self._posted_since(mark)
        if any(b[1] for b in batches):
            fail("05.3", f"rank {self.rank}: wait_all() posted a receive: it only sends what "
                 "waits and waits for the sends")  # fmt: skip
        if sum(b[0] for b in batches) != self.queued:
            fail("05.3", f"rank {self.rank}: wait_all() returned with {self.queued} send(s) "
                 f"waiting and posted {sum(b[0] for b in batches)}: a send was never posted. "
                 "It must send everything that waits, then wait for every send")  # fmt: skip
        self.queued = 0
        for w in self.state["works"]:
            if w.sends and not w.waited and not w.work.is_completed():
                fail("05.3", f"rank {self.rank}: wait_all() returned while a send was still in "
                     "flight: keep the work handles of the sends you posted and wait() on them")  # fmt: skip
        self.state["works"] = [w for w in self.state["works"] if not w.waited]


def mailbox_cases(ctx, mailbox_cls, cases, steps: int = 2):
    """Every (schedule, m) in ``cases``, one after the other, in one launch of the ranks."""
    for schedule, m in cases:
        mailbox_worker(ctx, mailbox_cls, schedule, m, steps)
        dist.barrier()
    return True


def mailbox_worker(ctx, mailbox_cls, schedule: str, m: int, steps: int = 2):
    state = {"in_batch": False, "batches": [], "works": []}
    real, batched = _batching(state)

    def watched_cls(group=None):
        return _Watched(mailbox_cls(group), state, ctx.rank)

    c10d.batch_isend_irecv = dist.batch_isend_irecv = batched
    try:
        with refusing_package_mailbox(mailbox_cls), _Watch(state):
            out = pipeline_worker(ctx, pipeline_mlp, schedule, m, steps=steps,
                                  global_batch=4 * m, mailbox_cls=watched_cls)  # fmt: skip
    finally:
        c10d.batch_isend_irecv = dist.batch_isend_irecv = real
    worst = worst_of(out["diffs"])  # NaN if any is NaN
    if not worst <= 1e-12:  # a NaN fails too
        fail("05.3", f"{schedule} with {ctx.world_size} stages and m={m}: rank {ctx.rank}'s "
             f"parameters differ from one process by {worst:.1e}: a message reached the wrong "
             "stage, or a receive returned before its data had arrived (wait on it)")  # fmt: skip
    return True
