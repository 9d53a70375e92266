"""course_utils.dist: one script, the same ctx under torchrun, launch and a single process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from course_utils import launch
from course_utils.dist import first_host, read_topology

# make test-floor runs these on the oldest torch too: init_process_group from the environment
pytestmark = [pytest.mark.floor]

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from course_utils import dist as cdist
    out = sys.argv[1]
    with cdist.session() as ctx:
        t = torch.tensor([ctx.rank + 1.0], device=ctx.device)
        dist.all_reduce(t)
        info = dict(rank=ctx.rank, world=ctx.world_size, local=ctx.local_rank, backend=ctx.backend,
                    device=str(ctx.device), sum=t.item(), source=ctx.extras["source"],
                    threads=torch.get_num_threads())
        with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(info, f)
    assert not dist.is_initialized()
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    return path, out


def read_all(out, n):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.multiprocess
def test_same_script_under_real_torchrun(script, tmp_path):
    path, out = script
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    infos = read_all(out, 2)
    assert [i["rank"] for i in infos] == [0, 1] and {i["world"] for i in infos} == {2}
    assert {i["sum"] for i in infos} == {3.0} and {i["source"] for i in infos} == {"torchrun"}
    assert {i["backend"] for i in infos} == {"gloo"} and [i["local"] for i in infos] == [0, 1]


@pytest.mark.multiprocess
def test_same_script_under_launch_and_alone(script, runs_root, tmp_path):
    path, out = script
    launch(path, 3, argv=[str(out)], echo=False)
    infos = read_all(out, 3)
    assert {i["sum"] for i in infos} == {6.0} and {i["source"] for i in infos} == {"launch"}
    single = tmp_path / "single"
    single.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE") and not k.startswith("SLURM_")
    }
    subprocess.run(
        [sys.executable, str(path), str(single)], check=True, timeout=120, env=env, cwd=tmp_path
    )
    (info,) = read_all(single, 1)
    assert info["world"] == 1 and info["sum"] == 1.0 and info["source"] == "single"


def test_slurm_variables():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456",
    }
    topo = read_topology(env)
    assert (topo.rank, topo.world_size, topo.local_rank, topo.local_world_size) == (5, 8, 1, 4)
    assert topo.source == "slurm" and topo.master_port == 20000 + 123456 % 20000
    assert topo.master_addr in ("gpu07",)  # scontrol or our own parser, same answer
    env["MASTER_PORT"] = "29999"
    assert read_topology(env).master_port == 29999


def test_torchrun_variables_win_over_slurm():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "1234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    topo = read_topology(env)
    assert (topo.rank, topo.world_size, topo.source, topo.master_port) == (1, 2, "torchrun", 1234)


@pytest.mark.parametrize(
    "nodelist, host",
    [("n1", "n1"), ("gpu[07-09,12]", "gpu07"), ("a[3],b[1-2]", "a3"), ("login1,login2", "login1")],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize(
    "env, threads",
    [
        # torchrun, 2 nodes x 2 ranks on 8-core nodes: a node's 8 cores split by its 2 ranks
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 4),
        # srun alone, 2 nodes x 4 tasks: SLURM_TASKS_PER_NODE gives the ranks on this node
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "1",
                "SLURM_TASKS_PER_NODE": "4(x2)",
                "SLURM_JOB_NODELIST": "n[1-2]",
            },
            2,
        ),  # fmt: skip
    ],
)
def test_ranks_split_their_nodes_cores_not_the_jobs(monkeypatch, tmp_path, env, threads):
    """The world spans nodes; the cores do not. Threads per rank = this node's usable cores divided
    by the ranks on this node (LOCAL_WORLD_SIZE), not by the world size."""
    import torch
    import torch.distributed as dist

    from course_utils import cpus
    from course_utils import dist as cdist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
                 "COURSE_RUN_DIR", "COURSE_BACKEND", "COURSE_DEVICE", "COURSE_INIT_METHOD"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cpus, "cpu_budget", lambda *a: cpus.CpuBudget(8, 8, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)  # no peers here
    got = []
    monkeypatch.setattr(torch, "set_num_threads", got.append)
    ctx = cdist.init()
    assert got == [threads] and ctx.local_world_size == 8 // threads
    assert ctx.world_size == int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS")))
