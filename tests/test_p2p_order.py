"""Point-to-point order that NCCL accepts: replay each rank's recorded batches under NCCL's rule.

With NCCL, one rank's P2P batches run one after another on one stream, and a large send completes
only when the matching receive is running on the peer. A schedule deadlocks when every rank's
current batch waits for a peer's *later* batch. gloo never shows it (its sends do not wait), so the
test records, on gloo ranks, the batches each rank posts, and replays them under NCCL's rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.models import pipeline_mlp
from course_utils.pipeline.parity import pipeline_worker

# make test-floor runs these on the oldest torch too: batch_isend_irecv and ProcessGroup's send/recv
pytestmark = [pytest.mark.floor]


def replay(batches: dict[int, list[list[tuple[str, int]]]]) -> list[int]:
    """Run every rank's batches under NCCL's rule; return the ranks left stuck (empty: no deadlock).

    ``batches[r]`` is rank r's list of batches, each a list of ``("send"|"recv", peer)``. The k-th
    send from a to b matches the k-th receive of b from a.
    """

    def numbered(r):
        count, out = {}, []
        for batch in batches[r]:
            ops = []
            for kind, peer in batch:
                key = (kind, peer)
                count[key] = count.get(key, 0) + 1
                ops.append((kind, peer, count[key]))
            out.append(ops)
        return out

    plan = {r: numbered(r) for r in batches}
    cursor = {r: 0 for r in plan}  # each rank's batch now running
    partner = {"send": "recv", "recv": "send"}

    def matched(r, kind, peer, k) -> bool:
        """Rank ``peer``'s op matching rank r's ``(kind, peer, k)`` is running or has finished."""
        want = (partner[kind], r, k)
        return any(want in b for b in plan[peer][: cursor[peer] + 1])

    progress = True
    while progress:
        progress = False
        for r in plan:
            if cursor[r] < len(plan[r]) and all(
                matched(r, kind, peer, k) for kind, peer, k in plan[r][cursor[r]]
            ):
                cursor[r] += 1
                progress = True
    return [r for r in plan if cursor[r] < len(plan[r])]


def test_replay_finds_the_classic_deadlock():
    """isend then recv on both sides of a pair, each op on its own: NCCL waits forever."""
    naive = {0: [[("send", 1)], [("recv", 1)]], 1: [[("send", 0)], [("recv", 0)]]}
    assert replay(naive) == [0, 1]
    batched = {0: [[("send", 1), ("recv", 1)]], 1: [[("send", 0), ("recv", 0)]]}
    assert replay(batched) == []


class P2PRecorder:
    """Record every P2P op this rank posts, grouped the way NCCL would run them.

    All P2P goes through ``ProcessGroup.send`` / ``recv`` (``dist.isend``, ``dist.recv``, and each
    op of ``batch_isend_irecv`` on gloo). Ops inside one ``batch_isend_irecv`` form one batch; any
    other op is a batch of its own.
    """

    def __init__(self):
        self.batches: list[list[tuple[str, int]]] = []
        self.open: list | None = None

    def __enter__(self):
        pg = dist.ProcessGroup
        self.saved = (pg.send, pg.recv, dist.batch_isend_irecv)
        send, recv, batch = self.saved

        def record(kind, peer):
            if self.open is not None:
                self.open.append((kind, peer))
            else:
                self.batches.append([(kind, peer)])

        def pg_send(group, tensors, dst, tag=0):
            record("send", dist.get_global_rank(group, dst))
            return send(group, tensors, dst, tag)

        def pg_recv(group, tensors, src, tag=0):
            record("recv", dist.get_global_rank(group, src))
            return recv(group, tensors, src, tag)

        def batched(ops):
            self.open = []
            try:
                return batch(ops)
            finally:
                self.batches.append(self.open)
                self.open = None

        pg.send, pg.recv, dist.batch_isend_irecv = pg_send, pg_recv, batched
        return self

    def __exit__(self, *exc):
        dist.ProcessGroup.send, dist.ProcessGroup.recv, dist.batch_isend_irecv = self.saved


def recorded_pipeline(ctx, schedule, m):
    with P2PRecorder() as rec:
        pipeline_worker(ctx, pipeline_mlp, schedule, m, steps=1, global_batch=4 * m, compare=False)
    return rec.batches


def isend_then_recv(ctx):
    """The pattern the runtime had before: a lone isend, then a lone blocking recv, both ways."""
    peer = 1 - ctx.rank
    with P2PRecorder() as rec:
        out, inp = torch.ones(4, device=ctx.device), torch.empty(4, device=ctx.device)
        work = dist.isend(out, peer)
        dist.recv(inp, peer)
        work.wait()
    return rec.batches


@pytest.mark.multiprocess
def test_recorder_sees_the_old_pattern_as_a_deadlock(runs_root):
    res = launch(isend_then_recv, 2, echo=False)
    assert res.results[0] == [[("send", 1)], [("recv", 1)]]
    assert replay(dict(enumerate(res.results))) == [0, 1]


def recorded_pipelines(ctx, cases):
    return [recorded_pipeline(ctx, s, m) for s, m in cases]


P2P_CASES = {2: [4], 3: [5], 4: [8, 2]}  # stages: micro-batch counts, each with both schedules


@pytest.mark.multiprocess
@pytest.mark.parametrize("p", list(P2P_CASES))
def test_pipeline_p2p_cannot_deadlock_on_nccl(runs_root, p):
    cases = [(s, m) for m in P2P_CASES[p] for s in ("gpipe", "1f1b")]
    res = launch(recorded_pipelines, p, cases=cases, echo=False, timeout=120)
    for i, case in enumerate(cases):
        batches = {rank: per_rank[i] for rank, per_rank in enumerate(res.results)}
        assert all(batches.values()), ("every stage talks to a neighbour", case)
        assert all(b for bs in batches.values() for b in bs), ("the recorder saw every batch", case)
        assert replay(batches) == [], (case, batches)
