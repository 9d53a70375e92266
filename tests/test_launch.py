"""The launcher contract (DESIGN.md): results, context, output, code by value, all on CPU/gloo."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from course_utils import launch, load_results
from course_utils.launcher.context import cpu_threads_per_rank
from tests.conftest import rank_pids, wait_dead

pytestmark = pytest.mark.multiprocess


def describe(ctx, scale=1.0):
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t)
    print(f"hello from {ctx.rank}")
    return {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "local": ctx.local_rank,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "run_dir": str(ctx.run_dir),
        "sum": t.item() * scale,
        "threads": torch.get_num_threads(),
        "env_rank": os.environ["RANK"],
        "initialized": dist.is_initialized(),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


@pytest.mark.floor  # a smoke test of the launcher on the oldest torch
def test_results_context_and_private_run_dir(runs_root, capfd):
    res = launch(describe, 3, scale=2.0)
    assert [r["rank"] for r in res.results] == [0, 1, 2]
    assert all(r["sum"] == 6.0 for r in res.results)  # (0+1+2) * 2
    assert {r["world"] for r in res.results} == {3}
    assert {r["backend"] for r in res.results} == {"gloo"} and res.backend == "gloo"
    assert {r["device"] for r in res.results} == {"cpu"}
    assert [r["env_rank"] for r in res.results] == ["0", "1", "2"]
    assert all(r["initialized"] for r in res.results)
    # CPU ranks split the cores instead of oversubscribing them
    assert {r["threads"] for r in res.results} == {cpu_threads_per_rank(3)}
    assert {r["ifname"] for r in res.results} <= {"lo", "lo0", None}
    assert res.run_dir.parent == runs_root and str(res.run_dir) == res.results[0]["run_dir"]
    assert stat.S_IMODE(res.run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(runs_root.stat().st_mode) == 0o700
    assert "hello from 2" in res.log(2) and res.wall_time > 0
    out = capfd.readouterr().out
    for r in range(3):
        assert f"[rank {r}] hello from {r}" in out
    assert load_results(res.run_dir) == dict(enumerate(res.results))
    assert wait_dead(rank_pids(res.run_dir)) == []


def test_output_is_live_not_at_the_end(runs_root, capfd):
    """Rank output reaches the parent while the rank still runs, not when it returns."""
    import threading

    def slow_printer(ctx):
        print("first line", flush=True)
        time.sleep(3)
        return 1

    seen = {}
    done = threading.Event()

    def watch():
        while not done.is_set() and "t" not in seen:
            if "first line" in capfd.readouterr().out:
                seen["t"] = time.monotonic()
            time.sleep(0.02)

    th = threading.Thread(target=watch)
    th.start()
    launch(slow_printer, 1)
    returned = time.monotonic()
    done.set()
    th.join()
    assert "t" in seen, "the rank's line never reached the parent's stdout"
    assert returned - seen["t"] > 2.0  # shown while the rank was still sleeping


@pytest.mark.floor  # a smoke test of the launcher on the oldest torch
def test_notebook_style_function_and_module_by_value(runs_root):
    """Code from a notebook cell lives in __main__: it must travel by value."""
    src = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch import nn

        class TinyNet(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 2)
            def forward(self, x):
                return self.fc(x)

        SCALE = 3.0

        def worker(ctx, steps=1):
            torch.manual_seed(0)
            net = TinyNet().to(ctx.device)
            for p in net.parameters():
                dist.all_reduce(p.data)
            return SCALE * float(net.fc.weight.detach().sum()) / ctx.world_size, type(net).__name__
    """)
    ns = {"__name__": "__main__"}
    exec(compile(src, "<notebook cell>", "exec"), ns)
    res = launch(ns["worker"], 2, steps=2)
    torch.manual_seed(0)
    expected = 3.0 * float(ns["TinyNet"]().fc.weight.detach().sum())
    assert res.results[0][1] == "TinyNet"
    assert res.results[0][0] == pytest.approx(expected, rel=1e-6) == res.results[1][0]


def test_importable_reference(runs_root):
    res = launch("course_utils.launcher.demo:hello", 3)
    assert [r["sum"] for r in res.results] == [6.0, 6.0, 6.0]


def test_script_path_runs_with_dist_init(runs_root, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from course_utils import dist as cdist
        with cdist.session() as ctx:
            t = torch.ones(1, device=ctx.device) * (ctx.rank + 1)
            dist.all_reduce(t)
            cdist.print0("total", t.item(), "argv", sys.argv[1:], "source", ctx.extras["source"])
    """)
    )
    res = launch(script, 2, argv=["--steps", "3"])
    assert res.results == [None, None]
    assert "total 3.0 argv ['--steps', '3'] source launch" in res.log(0)
    assert res.log(1) == ""


def test_manual_process_group(runs_root):
    """init_process_group=False: the worker makes the raw calls (notebook 03 shows them once)."""

    def raw(ctx, method):
        assert not dist.is_initialized()
        if method == "file":
            dist.init_process_group(
                "gloo", init_method=ctx.init_method, rank=ctx.rank, world_size=ctx.world_size
            )
        else:
            dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        t = torch.ones(1, device=ctx.device)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()

    for method in ("file", "env"):
        assert launch(raw, 2, init_process_group=False, method=method).results == [2.0, 2.0]


def test_two_launches_at_once_do_not_collide(tmp_path):
    """Two students on one node: two independent launchers, same moment, both succeed."""
    code = "from course_utils import launch; r = launch('course_utils.launcher.demo:hello', 2, echo=False); print(r.results[0]['sum'])"
    env = {**os.environ, "COURSE_RUNS_DIR": str(tmp_path / "runs")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(o[0].strip().endswith("3.0") for o in outs)


def test_spawn_start_method_also_works(runs_root):
    res = launch("course_utils.launcher.demo:hello", 2, start_method="spawn", echo=False)
    assert [r["sum"] for r in res.results] == [3.0, 3.0]


@pytest.mark.floor  # a smoke test of the launcher on the oldest torch
def test_dtensor_runs_end_clean_twenty_times(runs_root):
    """gloo threads alive after destroy_process_group used to abort ranks; results must survive."""
    import json

    from course_utils.launcher.supervise import read_record

    pinned = not torch.__version__.startswith("2.6.")  # the floor (make test-floor): 5 runs
    for i in range(20 if pinned else 5):
        res = launch("tests.workers:dtensor_sum", 2, echo=False, seed=i)
        assert res.results[0] == res.results[1] == pytest.approx(res.results[0])
        exitcodes = json.loads((res.run_dir / "launch.json").read_text())["exitcodes"]
        assert set(exitcodes.values()) == {0}, (i, exitcodes, res.log(0, "err"))
        assert read_record(res.run_dir, 0)["ok"]


def test_a_class_with_an_ops_attribute_travels_to_the_ranks():
    """A notebook class that reads ``self.ops`` and uses ``torch``: cloudpickle took it for a use
    of ``torch.ops`` (an _Ops module) and failed with "cannot pickle '_Ops' object"."""
    import cloudpickle

    from course_utils.launcher.spec import build_spec

    def __init__(self):
        self.ops = []

    def add(self, x):
        self.ops.append(torch.as_tensor(x))
        return len(self.ops)

    cls = type("Mailbox", (), {"__init__": __init__, "add": add, "__module__": "__main__"})

    def worker(ctx, box_cls=cls):
        return box_cls().add(1)

    spec, _ = build_spec(worker, {}, [])
    assert cloudpickle.loads(spec["fn"])(None) == 1
    assert cloudpickle.loads(cloudpickle.dumps(torch.ops)) is torch.ops
