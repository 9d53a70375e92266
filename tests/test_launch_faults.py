"""Faults: a rank that raises, dies, hangs, or a Ctrl-C. Each must end fast, name the rank,
leave no process behind, keep finished ranks' results, and leave the next launch working."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from course_utils import RankFailedError, RankTimeoutError, launch, load_results
from tests.conftest import only_run_dir, pid_alive, rank_pids, wait_dead

pytestmark = pytest.mark.multiprocess


def next_launch_works():
    assert launch("course_utils.launcher.demo:hello", 2, echo=False).results[1]["sum"] == 3.0


def raises_on_rank_1(ctx):
    if ctx.rank == 1:
        time.sleep(0.5)
        raise ValueError("boom at step 3")
    if ctx.rank == 2:
        time.sleep(120)  # would run for minutes if not stopped
    return f"rank {ctx.rank} finished"


@pytest.mark.floor  # a smoke test of the launcher on the oldest torch
def test_rank_raises(runs_root):
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(raises_on_rank_1, 3, init_process_group=False, echo=False)
    err = info.value
    assert time.monotonic() - t0 < 15
    assert err.rank == 1 and err.signal is None
    msg = str(err)
    assert "rank 1 raised ValueError: boom at step 3" in msg
    assert "raises_on_rank_1" in msg and "Traceback" in msg  # the rank's own traceback
    assert err.results == {0: "rank 0 finished"}
    run_dir = only_run_dir(runs_root)
    assert err.run_dir == run_dir and load_results(run_dir) == {0: "rank 0 finished"}
    assert json.loads((run_dir / "launch.json").read_text())["status"] == "RankFailedError"
    assert wait_dead(rank_pids(run_dir)) == []
    next_launch_works()


def killed_by_signal(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    time.sleep(120)


def test_rank_killed_by_signal(runs_root):
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(killed_by_signal, 2, init_process_group=False, echo=False)
    assert time.monotonic() - t0 < 15
    err = info.value
    assert err.rank == 1 and err.signal == signal.SIGKILL
    assert "rank 1 was killed by signal SIGKILL (9)" in str(err)
    assert "out-of-memory" in str(err)
    assert wait_dead(rank_pids(only_run_dir(runs_root))) == []
    next_launch_works()


def mismatched_collective(ctx):
    t = torch.ones(4, device=ctx.device)
    if ctx.rank == 0:
        dist.all_reduce(t)  # rank 1 never joins this all_reduce
    else:
        dist.recv(t, src=0)  # and rank 0 never sends
    return "unreachable"


@pytest.mark.floor  # a smoke test of the launcher on the oldest torch
def test_hang_shows_every_rank_stack(runs_root):
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        launch(mismatched_collective, 2, timeout=6, echo=False)
    elapsed = time.monotonic() - t0
    assert 6 <= elapsed < 20
    err = info.value
    assert sorted(err.stacks) == [0, 1]
    assert "all_reduce" in err.stacks[0] and "mismatched_collective" in err.stacks[0]
    assert "recv" in err.stacks[1]
    assert "timeout=6s" in str(err) and "mismatched collective" in str(err)
    assert wait_dead(rank_pids(only_run_dir(runs_root))) == []
    next_launch_works()


def sleeper(ctx):
    print("started", flush=True)
    time.sleep(120)


def test_ctrl_c_stops_every_rank(runs_root):
    """SIGINT to the launching process (Jupyter's interrupt) stops all ranks; the kernel lives on."""
    timer = threading.Timer(4.0, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(sleeper, 3, init_process_group=False, echo=False)
    assert time.monotonic() - t0 < 15
    run_dir = only_run_dir(runs_root)
    assert json.loads((run_dir / "launch.json").read_text())["status"] == "interrupted"
    assert wait_dead(rank_pids(run_dir)) == []
    next_launch_works()


def test_killed_launcher_leaves_no_orphan(tmp_path):
    """If the notebook kernel itself is killed, its ranks notice and exit."""
    code = textwrap.dedent("""
        import os, time
        from course_utils import launch
        def sleeper(ctx):
            pid_file = f"{ctx.run_dir}/../pid{ctx.rank}"
            with open(pid_file + ".tmp", "w") as f:  # whole, then renamed: never read half written
                f.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            time.sleep(120)
        launch(sleeper, 2, init_process_group=False)
    """)
    env = {**os.environ, "COURSE_RUNS_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid[0-9]"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid[0-9]")]
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    proc.kill()
    proc.wait()
    assert wait_dead(pids, within=5) == []


# ---- bad input: a clear error before any process starts ------------------------------------


def two_args(ctx, steps=1):
    return steps


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(world_size=0), ValueError, "world_size must be a positive integer"),
        (dict(world_size=-2), ValueError, "world_size must be a positive integer"),
        (dict(world_size=1.5), ValueError, "world_size must be a positive integer"),
        (dict(world_size=2, backend="mpi"), ValueError, "backend must be one of"),
        (dict(world_size=2, device="tpu"), ValueError, "device must be one of"),
        (
            dict(world_size=2, lr=0.1),
            TypeError,
            "two_args(ctx, steps=1) cannot be called as two_args(ctx, lr=...)",
        ),
        (dict(world_size=2, backend="nccl", device="cpu"), ValueError, "use backend='gloo'"),
        (dict(world_size=2, start_method="fork"), ValueError, "deadlocks in OpenMP"),
        (dict(world_size=2, timeout=0), ValueError, "timeout must be a positive"),
    ],
)
def test_bad_input_fails_before_start(runs_root, kwargs, exc, words):
    with pytest.raises(exc) as info:
        launch(two_args, **kwargs)
    assert words in str(info.value)
    assert not runs_root.exists() or not any(runs_root.iterdir())


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer than 64 visible GPUs")
def test_too_many_gpu_ranks_says_how_to_simulate(runs_root):
    with pytest.raises(ValueError) as info:
        launch(two_args, 64, device="cuda")
    assert "pass device='cpu' to simulate 64 ranks with gloo" in str(info.value)


def test_unpicklable_worker_is_refused_before_start(runs_root):
    lock = threading.Lock()

    def uses_lock(ctx):
        with lock:
            return 1

    with pytest.raises(TypeError) as info:
        launch(uses_lock, 2)
    assert "cannot be sent to the ranks" in str(info.value)
    assert not runs_root.exists() or not any(runs_root.iterdir())


def returns_unpicklable(ctx):
    import threading as th

    if ctx.rank == 1:
        time.sleep(1.0)  # rank 0 has returned by then
        return th.Lock()
    return "fine"


def test_unpicklable_return_names_rank_and_type(runs_root):
    with pytest.raises(RankFailedError) as info:
        launch(returns_unpicklable, 2, echo=False)
    assert info.value.rank == 1
    assert "rank 1 returned a value of type _thread.lock that cannot be pickled" in str(info.value)
    assert info.value.results == {0: "fine"}


def test_missing_script_and_bad_reference(runs_root, tmp_path):
    with pytest.raises(FileNotFoundError):
        launch(tmp_path / "nope.py", 2)
    with pytest.raises(ValueError, match="cannot import worker"):
        launch("course_utils.launcher.demo:nope", 2)
    with pytest.raises(TypeError, match="pass argv"):
        launch(__file__, 2, steps=3)
