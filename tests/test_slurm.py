"""The SLURM templates under a real SLURM: sbatch, srun and torchrun, one node and two.

The one-node cluster runs every template; the two-node cluster (two slurmd, each in its own network
namespace, see :mod:`tests.slurm_cluster`) runs the multi-node launch across the "nodes", checks
that 2 nodes x 2 ranks train to the same parameters as one process, that data is staged once per
node, and that a rank killed on one node ends the whole job with an error, not a hang.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from course_utils.compat import fsdp2_unsupported
from tests.conftest import pid_alive, wait_dead
from tests.slurm_cluster import Cluster, unavailable

REPO = Path(__file__).resolve().parents[1]
SUBMIT = str(REPO / "slurm_templates" / "submit")
pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def job_env(jobs: Path, **extra) -> dict:
    """What a user sets before submit: here, a CPU test cluster of 2 ranks per node."""
    return {
        "COURSE_PYTHON": sys.executable,
        "COURSE_SIZE": "ci",
        "JOBS_DIR": str(jobs),
        "PARTITION": "course",
        "GPUS_PER_NODE": "0",
        "RANKS_PER_NODE": "2",
        "CPUS_PER_RANK": "1",
        "TIME": "00:10:00",
        **extra,
    }


def finished(cluster: Cluster, job_id: int, jobs: Path, timeout: float = 300) -> tuple[dict, str]:
    info = cluster.wait(job_id, timeout)
    logs = list(jobs.glob(f"*-{job_id}.out"))
    text = logs[0].read_text() if logs else "(no job output file)"
    return info, text


def result_of(job_dir: Path) -> dict:
    return json.loads((job_dir / "result.json").read_text())


def fell(losses: list[float]) -> bool:
    k = max(2, len(losses) // 5)
    return sum(losses[-k:]) / k < sum(losses[:k]) / k - 0.05


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = Cluster.one_node(tmp_path_factory.mktemp("slurm1"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = unavailable(namespaces=True)
    if why:
        pytest.skip(why)
    cluster = Cluster.two_nodes(tmp_path_factory.mktemp("slurm2"))
    yield cluster
    cluster.stop()


def test_one_node_torchrun_trains_checkpoints_and_resumes(one_node, tmp_path):
    """one_node.sbatch (torchrun --standalone): 2 ranks, the loss falls, one trace per rank, and a
    second job given the same JOB_DIR resumes from rank 0's checkpoint."""
    job_dir = tmp_path / "resnet"
    env = job_env(tmp_path / "jobs", SITE="generic-nvidia", JOB_DIR=str(job_dir))
    first = one_node.submit([SUBMIT, "one_node", "--", "--epochs", "1"], env)
    info, log = finished(one_node, first, tmp_path / "jobs")
    assert info["JobState"] == "COMPLETED", log
    r1 = result_of(job_dir)
    assert r1["world_size"] == 2 and r1["source"] == "torchrun"
    assert sorted(x["rank"] for x in r1["ranks"]) == [0, 1]
    assert len(r1["traces"]) == 2 and all(Path(t).exists() for t in r1["traces"])
    assert list((job_dir / "tensorboard").glob("rank*.pt.trace.json"))
    assert (job_dir / "checkpoint.pt").exists()
    steps1 = r1["steps"]

    second = one_node.submit([SUBMIT, "one_node", "--", "--epochs", "3"], env)
    info, log = finished(one_node, second, tmp_path / "jobs")
    assert info["JobState"] == "COMPLETED", log
    r2 = result_of(job_dir)
    assert "resumed from" in log and r2["start_epoch"] == 1
    assert r2["steps"] == 3 * steps1
    assert r2["losses"][:steps1] == r1["losses"]  # the first epoch's curve came from the checkpoint
    assert fell(r2["losses"]), r2["losses"]


def test_srun_only_reads_ranks_from_slurm(one_node, tmp_path):
    """srun_only.sbatch: one task per rank, rank and world size from SLURM_PROCID/SLURM_NTASKS
    (SLURM sets no WORLD_SIZE); the ZeRO-2 script trains and rank 0 alone writes the checkpoint."""
    job_dir = tmp_path / "zero"
    env = job_env(tmp_path / "jobs", SITE="generic-nvidia", JOB_DIR=str(job_dir),
                  SCRIPT="train/zero.py")  # fmt: skip
    job = one_node.submit(
        [SUBMIT, "srun_only", "--", "--method", "zero2", "--epochs", "3", "--profile", "off"], env
    )
    info, log = finished(one_node, job, tmp_path / "jobs")
    assert info["JobState"] == "COMPLETED", log
    r = result_of(job_dir)
    assert r["script"] == "zero2" and r["source"] == "slurm" and r["world_size"] == 2
    assert sorted(x["local_rank"] for x in r["ranks"]) == [0, 1]
    assert fell(r["losses"]), r["losses"]
    import torch

    state = torch.load(job_dir / "checkpoint.pt", weights_only=True)
    assert state["strategy"] == "zero2" and state["epoch"] == 3
    assert state["optimizer"]["state"], "the consolidated optimizer state is empty"


@pytest.mark.skipif(bool(fsdp2_unsupported("cpu")), reason=str(fsdp2_unsupported("cpu")))
def test_one_node_fsdp2(one_node, tmp_path):
    job_dir = tmp_path / "fsdp2"
    env = job_env(tmp_path / "jobs", SITE="generic-nvidia", JOB_DIR=str(job_dir),
                  SCRIPT="train/zero.py")  # fmt: skip
    job = one_node.submit([SUBMIT, "one_node", "--", "--method", "fsdp2", "--epochs", "3"], env)
    info, log = finished(one_node, job, tmp_path / "jobs")
    assert info["JobState"] == "COMPLETED", log
    r = result_of(job_dir)
    assert r["script"] == "fsdp2" and fell(r["losses"]), r["losses"]


def test_cpu_template_3d_equals_one_process(one_node, tmp_path):
    job_dir = tmp_path / "3d"
    env = job_env(tmp_path / "jobs", JOB_DIR=str(job_dir), SCRIPT="train/threed.py")
    job = one_node.submit([SUBMIT, "cpu", "--", "--tp", "2", "--check"], env)
    info, log = finished(one_node, job, tmp_path / "jobs")
    assert info["JobState"] == "COMPLETED", log
    r = result_of(job_dir)
    assert r["dims"] == {"dp": 1, "pp": 1, "tp": 2} and r["backend"] == "gloo"
    assert r["max_param_diff"] < 1e-9 and r["max_loss_diff"] < 1e-9


def test_bad_template_and_site_are_named(one_node, tmp_path):
    env = job_env(tmp_path / "jobs")
    bad = one_node.run(SUBMIT, "two_nodes", env=env, check=False)
    assert bad.returncode == 2 and "multi_node" in bad.stderr and "one_node" in bad.stderr
    bad = one_node.run(SUBMIT, "one_node", env={**env, "SITE": "nowhere"}, check=False)
    assert bad.returncode == 2 and "lumi-rocm" in bad.stderr


def test_templates_fix_no_port_and_no_personal_path():
    """Every site value is ${VAR:-default}: no fixed port, no home directory, no user name."""
    root = REPO / "slurm_templates"
    for f in [*root.glob("*.sbatch"), *root.glob("sites/*.env"), root / "lib" / "job.sh"]:
        text = f.read_text()
        assert "/home/" not in text and "/users/" not in text, f
        for line in text.splitlines():
            if line.lstrip().startswith("export ") and "=" in line and "$(" not in line:
                value = line.split("=", 1)[1]
                assert value.startswith('"${') or value.startswith("${"), (f, line)
        assert "29500" not in text and "MASTER_PORT=2" not in text, f


def test_multi_node_across_two_namespaces_equals_one_process(two_nodes, tmp_path):
    """multi_node.sbatch: srun starts one torchrun per node, c10d rendezvous on cn1, 2 nodes x 2
    ranks; TP groups stay inside a node, DP crosses them, and every parameter equals one process."""
    job_dir = tmp_path / "3d"
    env = job_env(tmp_path / "jobs", SITE="generic-nvidia", NODES="2", JOB_DIR=str(job_dir),
                  SCRIPT="train/threed.py", GLOO_SOCKET_IFNAME="eth0")  # fmt: skip
    job = two_nodes.submit(
        [SUBMIT, "multi_node", "--", "--tp", "2", "--steps", "3", "--check"], env
    )
    info, log = finished(two_nodes, job, tmp_path / "jobs")
    assert info["JobState"] == "COMPLETED", log + two_nodes.logs()
    r = result_of(job_dir)
    hosts = {x["rank"]: x["host"] for x in r["ranks"]}
    assert hosts == {0: "cn1", 1: "cn1", 2: "cn2", 3: "cn2"}, hosts
    assert r["dims"] == {"dp": 2, "pp": 1, "tp": 2}
    tp_groups = {tuple(x["ranks"]["tp"]) for x in r["ranks"]}  # each rank's own TP group
    assert all(len({hosts[k] for k in g}) == 1 for g in tp_groups)  # TP inside a node
    assert r["max_param_diff"] < 1e-9 and r["max_loss_diff"] < 1e-9
    assert f"rendezvous {two_nodes.nodes['cn1']}:" in log


def test_cpu_template_on_two_nodes_stages_data_once_per_node(two_nodes, tmp_path):
    """The DDP script over 2 nodes with --stage-to: local rank 0 of *each* node copies the data."""
    from tests.test_data import write_cifar100

    data = tmp_path / "shared-data"
    write_cifar100(data, n=64)
    job_dir = tmp_path / "ddp"
    local = tmp_path / "local-{host}"
    env = job_env(tmp_path / "jobs", NODES="2", JOB_DIR=str(job_dir), GLOO_SOCKET_IFNAME="eth0")
    job = two_nodes.submit(
        [SUBMIT, "cpu", "--", "--data-dir", str(data), "--stage-to", str(local), "--no-verify",
         "--epochs", "1", "--profile", "off"],
        env,
    )  # fmt: skip
    info, log = finished(two_nodes, job, tmp_path / "jobs")
    assert info["JobState"] == "COMPLETED", log + two_nodes.logs()
    r = result_of(job_dir)
    assert r["world_size"] == 4 and not r["synthetic"] and "CIFAR100" in r["data"]
    for node in ("cn1", "cn2"):
        assert (tmp_path / f"local-{node}" / ".staged").exists(), node
        assert (tmp_path / f"local-{node}" / "cifar-100-python" / "train").exists()


def test_a_rank_killed_on_one_node_ends_the_whole_job(two_nodes, tmp_path):
    job_dir = tmp_path / "long"
    env = job_env(tmp_path / "jobs", NODES="2", JOB_DIR=str(job_dir), GLOO_SOCKET_IFNAME="eth0")
    job = two_nodes.submit([SUBMIT, "cpu", "--", "--epochs", "200", "--profile", "off"], env)
    deadline = time.monotonic() + 180
    ranks = job_dir / "ranks"
    while len(list(ranks.glob("rank*.json"))) < 4 or not (job_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, two_nodes.job(job)
        time.sleep(0.5)
    where = {int(f.stem[4:]): json.loads(f.read_text()) for f in ranks.glob("rank*.json")}
    victim = where[3]
    assert victim["host"] == "cn2"
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    info, log = finished(two_nodes, job, tmp_path / "jobs", timeout=120)
    took = time.monotonic() - t0
    assert info["JobState"] in ("FAILED", "CANCELLED"), (info, log)
    assert "rank      : 3" in log or "rank: 3" in log, log[-3000:]
    assert "SIGKILL" in log or "Signal 9" in log, log[-3000:]
    assert wait_dead([w["pid"] for w in where.values()], within=30) == []
    assert not any(pid_alive(w["pid"]) for w in where.values())
    print(f"job ended {took:.0f} s after rank 3 was killed")


def test_preflight_template_writes_one_report(one_node, tmp_path):
    """preflight.sbatch on a compute node: doctor, all_reduce, the benchmark and a notebook, one
    report in Markdown and JSON."""
    job_dir = tmp_path / "preflight"
    env = job_env(tmp_path / "jobs", SITE="cpu-cluster", JOB_DIR=str(job_dir), SIZE="ci",
                  PREFLIGHT_ONLY="01")  # fmt: skip
    job = one_node.submit([SUBMIT, "preflight"], env)
    info, log = finished(one_node, job, tmp_path / "jobs", timeout=600)
    assert info["JobState"] == "COMPLETED", log
    report = json.loads((job_dir / "preflight.json").read_text())
    assert report["verdict"] == "PASS", report
    assert report["slurm_job"] == str(job)
    assert [n["notebook"] for n in report["notebooks"]] == ["01_single_gpu"]
    assert report["checks"]["all_reduce (gloo, 2 ranks)"] == "ok"
    text = (job_dir / "preflight.md").read_text()
    assert text.startswith("# Pre-flight of") and "PASS" in text.splitlines()[0]
    assert (job_dir / "notebooks" / "01_single_gpu.html").exists()


def test_requeue_stops_at_a_step_requeues_and_ends_like_an_uninterrupted_job(one_node, tmp_path):
    """requeue.sbatch: SIGUSR1 to the batch shell partway (what ``--signal=B:USR1@120`` sends
    before the time limit) makes every rank checkpoint after the same step; the job requeues
    itself, starts again with the same id and job dir (SLURM_RESTART_COUNT=1), resumes at that
    step, and ends with the losses and parameters of the same job left alone."""
    import torch

    jobs = tmp_path / "jobs"
    env = job_env(jobs, SITE="generic-nvidia")  # no JOB_DIR: the template derives it from the id
    argv = [SUBMIT, "requeue", "--", "--epochs", "2", "--profile", "off"]
    alone = one_node.submit(argv, env)
    job = one_node.submit(argv, env)
    metrics = jobs / f"course-requeue-{job}" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
        assert time.monotonic() < deadline, one_node.job(job)
        time.sleep(0.2)
    one_node.run("scancel", "--signal=USR1", "--batch", str(job))
    while (info := one_node.job(job)).get("Restarts") != "1" or info["JobState"] != "PENDING":
        assert time.monotonic() < deadline + 60 and info["JobState"] != "COMPLETED", info
        time.sleep(0.2)
    # SLURM holds a requeued job for AuthInfo's cred_expire (120 s by default), Reason=BeginTime;
    # the test waits 2 s only (a start in the second of the requeue is refused: "Job credential
    # revoked")
    time.sleep(2)
    one_node.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    info, log = finished(one_node, job, jobs)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log)
    assert "requeueing job" in log and f"start 2 of job {job}" in log, log
    stopped_at = int(log.split("stopped on request after step ")[1].split(":")[0])
    assert f"batch {stopped_at % 16} of it, step {stopped_at}" in log, log  # 16 steps an epoch
    info, log_alone = finished(one_node, alone, jobs)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log_alone

    r, r_alone = (result_of(jobs / f"course-requeue-{j}") for j in (job, alone))
    assert 5 <= r["start_step"] == stopped_at < r["steps"] == r_alone["steps"] == 32
    assert r["losses"] == r_alone["losses"] and r["test_accuracy"] == r_alone["test_accuracy"]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 33))  # every step once, across the two starts
    w, w_alone = (
        torch.load(jobs / f"course-requeue-{j}" / "checkpoint.pt", weights_only=True)["model"]
        for j in (job, alone)
    )
    assert all(torch.equal(w[k], w_alone[k]) for k in w_alone)
