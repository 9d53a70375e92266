"""A stopped run stops every process it created, at any depth, however the run ends.

Each rank starts DataLoader workers (``num_workers=2``), a plain ``subprocess.Popen`` child,
and a grandchild below that child. Whether the run ends well, with a rank that raises, a rank
killed by a signal, a timeout, Ctrl-C, or the launching process killed (reaped or left a zombie),
none of them may outlive it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from course_utils import RankFailedError, RankTimeoutError, launch
from course_utils.launcher.supervise import read_record, stop
from tests.conftest import descendants, only_run_dir, pid_alive, wait_dead

pytestmark = pytest.mark.multiprocess


def start_children(ctx) -> list[int]:
    """DataLoader workers, a child and a grandchild; their pids are written for the test."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(
        TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2, persistent_workers=True
    )
    it = iter(loader)
    next(it)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)",
        ]
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(descendants(os.getpid())) < 4:
        time.sleep(0.05)  # 2 workers + child + grandchild
    tree = descendants(os.getpid())
    (ctx.run_dir / f"rank{ctx.rank}.tree.json").write_text(json.dumps(tree))
    ctx.extras["keep"] = (it, child)  # alive until the rank ends
    workers = [w.pid for w in it._workers]  # the DataLoader's own list of worker processes
    return {
        "tree": tree,
        "workers_ppid": [
            int(open(f"/proc/{w}/stat").read().rsplit(")", 1)[1].split()[1]) for w in workers
        ],
        "pgids": [os.getpgid(p) for p in tree],
        "rank": os.getpid(),
    }


def with_children(ctx, how):
    info = start_children(ctx)
    if how == "ok":
        return info
    deadline = time.monotonic() + 60
    while len(list(ctx.run_dir.glob("rank*.tree.json"))) < ctx.world_size:
        assert time.monotonic() < deadline, "the other rank never started its children"
        time.sleep(0.05)  # every rank has its tree before any rank fails
    if how == "raise" and ctx.rank == 1:
        raise ValueError("boom")
    if how == "sigkill" and ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)


def wait_for_trees(run_dir, world_size: int, within: float = 60) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        files = list(run_dir.glob("rank*.tree.json"))
        if len(files) == world_size:
            time.sleep(0.2)
            return [pid for f in files for pid in json.loads(f.read_text())]
        time.sleep(0.1)
    raise AssertionError(f"ranks never reported their children under {run_dir}")


def recorded_tree(runs_root) -> list[int]:
    run_dir = only_run_dir(runs_root)
    pids = [pid for f in run_dir.glob("rank*.tree.json") for pid in json.loads(f.read_text())]
    assert len(pids) >= 8, pids  # 2 ranks x (2 workers + child + grandchild)
    return pids


def test_tree_has_dataloader_workers_as_the_ranks_own_children(runs_root):
    """Workers are forked by the rank itself (not by a forkserver) and everything is in its group."""
    res = launch(with_children, 2, how="ok", echo=False)
    for info in res.results:
        assert len(info["tree"]) >= 4, info
        assert info["workers_ppid"] == [info["rank"]] * 2, info
        assert set(info["pgids"]) == {info["rank"]}, info


def test_normal_end_leaves_nothing(runs_root):
    launch(with_children, 2, how="ok", echo=False)
    assert wait_dead(recorded_tree(runs_root)) == []


@pytest.mark.floor  # a smoke test of the launcher on the oldest torch
def test_rank_raises_leaves_nothing(runs_root):
    with pytest.raises(RankFailedError):
        launch(with_children, 2, how="raise", echo=False)
    assert wait_dead(recorded_tree(runs_root)) == []


def test_rank_killed_by_signal_leaves_nothing(runs_root):
    """The rank itself is gone (SIGKILL, as from the OOM killer); its children must go too."""
    with pytest.raises(RankFailedError) as info:
        launch(with_children, 2, how="sigkill", echo=False)
    assert info.value.signal == signal.SIGKILL
    assert wait_dead(recorded_tree(runs_root)) == []


def test_timeout_leaves_nothing(runs_root, tmp_path, monkeypatch):
    # A run that ends well first, in a folder of its own, starts the ranks' forkserver (torch
    # imported): the hanging ranks then have their children within a second or two, well inside a
    # 10 s timeout that is waited out in full (25 s before, most of it margin for a cold start).
    # Ranks too slow for it fail loudly: recorded_tree asserts every rank's children were there.
    with monkeypatch.context() as mp:
        mp.setenv("COURSE_RUNS_DIR", str(tmp_path / "warm-up"))
        launch(with_children, 2, how="ok", echo=False)
    with pytest.raises(RankTimeoutError):
        launch(with_children, 2, how="hang", timeout=10, echo=False)
    assert wait_dead(recorded_tree(runs_root)) == []


def test_ctrl_c_leaves_nothing(runs_root):
    def interrupt_when_ready():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if runs_root.exists() and any(runs_root.iterdir()):
                wait_for_trees(only_run_dir(runs_root), 2)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.1)

    th = threading.Thread(target=interrupt_when_ready)
    th.start()
    with pytest.raises(KeyboardInterrupt):
        launch(with_children, 2, how="hang", echo=False)
    th.join()
    assert wait_dead(recorded_tree(runs_root)) == []


LAUNCHER = textwrap.dedent("""
    from course_utils import launch
    from tests.test_launch_cleanup import with_children
    launch(with_children, 2, how="hang")
""")


@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_killed_launcher_leaves_nothing(tmp_path, reap):
    """The kernel dies (SIGKILL). Reaped or left a zombie by its parent, its ranks notice."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "COURSE_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": root}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env, cwd=root)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        tree = wait_for_trees(only_run_dir(tmp_path / "runs"), 2)
        ranks = [pid for pid in descendants(proc.pid) if pid not in tree]  # forkserver and ranks
        assert all(pid_alive(p) for p in tree)
        proc.kill()
        if reap:
            proc.wait()
        else:  # a zombie: dead, its pid still taken, os.kill(pid, 0) still succeeds
            deadline = time.monotonic() + 5
            while pid_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(proc.pid, 0)
        assert wait_dead(tree + ranks, within=10) == []
    finally:
        proc.kill()
        proc.wait()


def ignores_sigterm(ctx):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (ctx.run_dir / f"rank{ctx.rank}.ready").write_text(str(os.getpid()))
    if ctx.rank == 1:
        deadline = time.monotonic() + 60
        while not (ctx.run_dir / "rank0.ready").exists():  # rank 0 ignores SIGTERM before we fail
            assert time.monotonic() < deadline, "rank 0 never got to ignore SIGTERM"
            time.sleep(0.05)
        raise ValueError("stop the others")
    time.sleep(300)


def test_rank_ignoring_sigterm_is_killed(runs_root):
    """stop() escalates to SIGKILL: a rank that ignores SIGTERM still ends, within seconds.

    The rank's watchdog would kill it anyway once launch closes the liveness pipe, but only after
    launch.json is written: the exit code recorded there shows that stop() itself killed it.
    """
    with pytest.raises(RankFailedError):
        launch(ignores_sigterm, 2, init_process_group=False, echo=False)
    ended = time.time()
    run_dir = only_run_dir(runs_root)
    codes = json.loads((run_dir / "launch.json").read_text())["exitcodes"]
    assert codes == {"0": -signal.SIGKILL, "1": 1}, (
        f"exit codes when launch returned: {codes}; rank 0 ignores SIGTERM, so stop() must "
        "have sent SIGKILL (None: it was still running)"
    )
    failed = read_record(run_dir, 1)["time"]  # when rank 1 raised; start-up is not counted
    assert ended - failed < 10, f"launch returned {ended - failed:.1f}s after rank 1 failed"
    pid = int((run_dir / "rank0.ready").read_text())
    assert wait_dead([pid], within=1) == []


def sleep_ignoring_sigterm(ready) -> None:
    os.setsid()  # a group leader, as a rank is
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(300)


def test_stop_kills_a_process_that_ignores_sigterm():
    """No liveness pipe here: only stop()'s own SIGKILL can end this process."""
    mp = multiprocessing.get_context("fork")
    ready = mp.Event()
    proc = mp.Process(target=sleep_ignoring_sigterm, args=(ready,), daemon=True)
    proc.start()
    try:
        assert ready.wait(30), "the child never got to ignore SIGTERM"
        stop({0: proc}, grace=0.2)
        assert proc.exitcode == -signal.SIGKILL, (
            f"stop() returned with exit code {proc.exitcode} (None: still running); "
            "it must escalate to SIGKILL after the grace period"
        )
    finally:
        proc.kill()
        proc.join()
