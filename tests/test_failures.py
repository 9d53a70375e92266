"""Failures (notebook 11): a rank dies mid-step and the job resumes bit for bit, under ``launch``
and under ``torchrun --max-restarts 1``; hangs under launch's timeout and the process group's; the
flight recorder on gloo.

The reference for every resume is the same training run without a failure (:func:`train_worker`
with no ``fail_rank``), compared exactly (``torch.equal``, float64).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_utils import RankFailedError, RankTimeoutError, launch
from course_utils.checkpoint import failures, hangs, latest
from course_utils.checkpoint.failures import crash_and_resume, train_worker

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """12 steps, a checkpoint every 4, no failure: the per-rank results to match."""
    root = tmp_path_factory.mktemp("whole")
    return launch(
        train_worker, 2, root=str(root / "ckpts"), echo=False, runs_root=root / "runs"
    ).results


def same_training(resumed: list, whole: list, start: int) -> None:
    for r in range(2):
        assert resumed[r]["started_at"] == start
        assert sorted(resumed[r]["losses"]) == list(range(start + 1, 13))
        assert all(resumed[r]["losses"][s] == whole[r]["losses"][s] for s in resumed[r]["losses"])
        p, q = resumed[r]["params"], whole[r]["params"]
        assert sorted(p) == sorted(q) and all(torch.equal(p[k], q[k]) for k in p), r
    assert whole[0]["losses"][8] != whole[1]["losses"][8]  # the ranks' batches really differ


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_rank_dies_mid_step_and_launch_resumes(tmp_path, runs_root, uninterrupted, how):
    """Rank 1 dies in step 7 (after its backward); the launch names it; the next launch resumes
    from step 4's checkpoint and ends with the uninterrupted run's losses and parameters."""
    rec = crash_and_resume(tmp_path / "ckpts", fail_rank=1, fail_step=7, how=how)
    assert rec.error.rank == 1
    if how == "exit":
        assert "rank 1 exited with code 1" in str(rec.error) and rec.error.exc_type is None
    else:
        assert rec.error.exc_type == "RuntimeError"
        assert rec.error.exc_message == "rank 1 failed in step 7"
    same_training(rec.results, uninterrupted, start=4)
    lost = rec.lost
    assert (lost.failed_step, lost.resumed_from, lost.steps_redone) == (7, 4, 2)
    assert all(0 < t < 30 for t in (lost.seconds_lost, lost.restart_seconds, lost.redo_seconds))
    with pytest.raises(ValueError, match="holds an earlier run"):  # it would only resume it
        crash_and_resume(tmp_path / "ckpts")


def write_events(root: Path, rank: int, events: list[tuple]) -> None:
    lines = [json.dumps({"event": e, "t": t, **({"step": s} if s is not None else {})})
             for e, t, s in events]  # fmt: skip
    (root / f"events-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_lost_work_by_hand(tmp_path):
    """Against hand-written logs: a death after a checkpoint, and one before any checkpoint."""
    write_events(tmp_path, 1, [("start", 0.0, None), ("step", 1.0, 1), ("step", 2.0, 2),
                               ("saved", 2.5, 2), ("step", 3.5, 3), ("dies", 4.2, 4),
                               ("start", 6.0, None), ("resumed", 7.0, 2), ("step", 8.0, 3),
                               ("step", 9.0, 4)])  # fmt: skip
    lost = failures.lost_work(tmp_path, 1)
    assert (lost.failed_step, lost.resumed_from, lost.steps_redone) == (4, 2, 1)
    assert (lost.seconds_lost, lost.restart_seconds, lost.redo_seconds) == pytest.approx(
        (4.2 - 2.5, 7.0 - 4.2, 8.0 - 7.0))  # fmt: skip
    write_events(tmp_path, 0, [("start", 0.0, None), ("step", 1.0, 1), ("dies", 1.5, 2),
                               ("start", 3.0, None), ("step", 4.0, 1)])  # fmt: skip
    lost = failures.lost_work(tmp_path, 0)
    assert (lost.failed_step, lost.resumed_from, lost.steps_redone) == (2, 0, 1)
    assert (lost.seconds_lost, lost.restart_seconds, lost.redo_seconds) == pytest.approx(
        (1.5, 1.5, 1.0))  # fmt: skip


def run_torchrun(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """Run torchrun; past ``timeout``, SIGTERM it (its agent stops the workers, which live in
    sessions of their own), then SIGKILL."""
    with open(cwd / "torchrun.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = None
        log.seek(0)
        return code, log.read()


def test_torchrun_restarts_and_resumes(tmp_path, uninterrupted):
    """torchrun --max-restarts 1: rank 1 dies in step 7 of the first attempt, the agent restarts
    both ranks, they resume from step 4 and end as the uninterrupted run.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the rendezvous' store shared (the default), the
    restarted ranks meet the first attempt's keys and gloo's connect hangs or fails in about half
    the runs (elastic_demo's docstring has the counts)."""
    root = tmp_path / "ckpts"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", "PYTHONPATH": path,
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2",
           "-m", "course_utils.checkpoint.elastic_demo", "--root", str(root)]  # fmt: skip
    code, log = run_torchrun(cmd, tmp_path, env, timeout=60)
    assert code == 0, log[-4000:]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in log, log[-4000:]
    assert "rank 1 dies in step 7 (exit)" in log and "rank 1: attempt 1" in log
    results = [torch.load(root / f"final-rank{r}.pt", weights_only=False) for r in range(2)]
    assert [res["attempt"] for res in results] == [1, 1]
    same_training(results, uninterrupted, start=4)
    lost = failures.lost_work(root, 1)
    assert (lost.failed_step, lost.resumed_from, lost.steps_redone) == (7, 4, 2)
    assert latest(root).name == "step-00000012"


# --- hangs -----------------------------------------------------------------------------------
def line_of(marker: str) -> int:
    """The line of hangs.py that holds ``marker`` (a comment in collectives_then_mismatch)."""
    lines = Path(hangs.__file__).read_text().splitlines()
    found = [i + 1 for i, line in enumerate(lines) if marker in line]
    assert len(found) == 1, (marker, found)
    return found[0]


def test_hang_under_launch_timeout_shows_each_rank_line(runs_root):
    """Rank 0 all-reduces while rank 1 broadcasts: launch's timeout ends it with both stacks,
    each naming the line its rank waits on."""
    hang = hangs.mismatch("op", timeout=4.0)
    assert isinstance(hang.error, RankTimeoutError) and 4 <= hang.seconds < 15
    where = "hangs.py:{} in collectives_then_mismatch"
    assert hang.where == {0: where.format(line_of("# rank 0 waits here")),
                          1: where.format(line_of("# the others wait here (op)"))}  # fmt: skip
    assert "all_reduce" in hang.error.stacks[0] and "broadcast" in hang.error.stacks[1]


def test_process_group_timeout_raises_in_the_rank(runs_root):
    """The same mismatch in a group made with timeout=2 s: gloo's own error, long before launch's
    timeout, reported as the failure of a named rank."""
    hang = hangs.mismatch("op", timeout=60.0, pg_timeout=2.0)
    err = hang.error
    assert isinstance(err, RankFailedError) and err.rank in (0, 1) and hang.seconds < 15
    assert err.exc_type == "RuntimeError"
    assert re.search(r"Timed out waiting 2000ms for (recv|send) operation", err.exc_message)


def test_size_mismatch_aborts_a_gloo_rank(runs_root):
    """4 elements against 8: no hang on gloo; rank 0 receives more bytes than it expects and
    aborts (SIGABRT) with gloo's hint."""
    hang = hangs.mismatch("size", timeout=30.0)
    err = hang.error
    assert isinstance(err, RankFailedError) and err.rank == 0 and err.signal == signal.SIGABRT
    assert "Received data size doesn't match expected size" in str(err)


# --- the flight recorder ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["op", "skip"])
def test_flight_recorder_finds_the_mismatched_collective(runs_root, kind):
    """Gloo records its collectives (torch 2.14.1: on by default): the dumps agree on collectives
    1 and 2 and part at 3, where rank 0 all-reduces and rank 1 broadcasts, or calls no collective
    (it waits in a recv, which gloo does not record)."""
    fr = hangs.flight_record(kind, pg_timeout=2.0)
    assert fr.note.startswith("6 records" if kind == "op" else "5 records"), fr.note
    for r in (0, 1):
        # a rank whose peer gave up first and exited sees the connection close instead
        assert re.search("Timed out waiting 2000ms|Connection closed by peer", fr.errors[r])
        recs = fr.records[r]
        assert [(x.seq, x.op, x.input_sizes) for x in recs[:2]] == [
            (1, "gloo:all_reduce", ((4,),)), (2, "gloo:broadcast", ((4,),))]  # fmt: skip
        assert all(x.state == "scheduled" and not x.p2p for x in recs)  # no events, no p2p
        assert [x.retired for x in recs[:2]] == [True, True]
    d = hangs.first_disagreement(fr.records)
    assert d is not None and d.seq == 3 and d.calls[0].op == "gloo:all_reduce"
    assert (d.calls[1].op if d.calls[1] else None) == {"op": "gloo:broadcast", "skip": None}[kind]
    where = "hangs.py:{} in collectives_then_mismatch"  # the recorder kept each call's stack
    assert d.calls[0].where == where.format(line_of("# rank 0 waits here"))
    if kind == "op":
        assert d.calls[1].where == where.format(line_of("# the others wait here (op)"))
    assert fr.status[0]["0"]["last_enqueued_collective"] == 3
    assert fr.status[1]["0"]["last_enqueued_collective"] == {"op": 3, "skip": 2}[kind]
    assert hangs.first_disagreement({r: fr.records[r][:2] for r in (0, 1)}) is None


def test_flight_recorder_off_says_so(runs_root):
    """TORCH_FR_BUFFER_SIZE=0 before the group: nothing recorded, and the note says so."""
    fr = hangs.flight_record("op", pg_timeout=2.0, buffer=0)
    assert fr.records == {0: [], 1: []}
    assert "recorded nothing on gloo" in fr.note and "TORCH_FR_BUFFER_SIZE=0" in fr.note
    assert hangs.first_disagreement(fr.records) is None


@pytest.mark.floor
def test_a_torch_without_gloos_recorder_says_so(runs_root):
    """Torch 2.6 has NCCL's flight recorder only: the dump is a note, not an AttributeError."""
    from torch._C import _distributed_c10d as c10d

    if hasattr(c10d, "_dump_fr_trace"):
        pytest.skip(f"torch {torch.__version__} records gloo's collectives (tested above)")
    fr = hangs.flight_record("op", pg_timeout=2.0)
    assert fr.records == {0: [], 1: []} and "has no flight recorder for gloo" in fr.note
    assert hangs.first_disagreement(fr.records) is None
