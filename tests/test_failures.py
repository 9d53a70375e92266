"""Failures (notebook 11): a rank dies mid-step and the job resumes bit for bit, under ``launch``
and under ``torchrun --max-restarts 1``; hangs under launch's timeout and the process group's; the
flight recorder on gloo.

The reference for every resume is the same training run without a failure (:func:`train_worker`
with no ``fail_rank``), compared exactly (``torch.equal``, float64).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_utils import launch
from course_utils.checkpoint import failures, latest
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
    assert (
        0 < lost.seconds_lost < 30 and 0 < lost.restart_seconds < 30 and 0 < lost.redo_seconds < 30
    )


def test_torchrun_restarts_and_resumes(tmp_path, uninterrupted):
    """torchrun --max-restarts 1: rank 1 dies in step 7 of the first attempt, the agent restarts
    both ranks, they resume from step 4 and end as the uninterrupted run."""
    root = tmp_path / "ckpts"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2",
           "-m", "course_utils.checkpoint.elastic_demo", "--root", str(root)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in log, log[-4000:]
    assert "rank 1 dies in step 7 (exit)" in log
    results = [torch.load(root / f"final-rank{r}.pt", weights_only=False) for r in range(2)]
    assert [res["attempt"] for res in results] == [1, 1]
    same_training(results, uninterrupted, start=4)
    lost = failures.lost_work(root, 1)
    assert (lost.failed_step, lost.resumed_from, lost.steps_redone) == (7, 4, 2)
    assert latest(root).name == "step-00000012"
