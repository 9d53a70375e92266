"""The training scripts under launch, on real CIFAR-100 files: the same file torchrun and srun run
(tests/test_slurm.py submits them to a real SLURM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from course_utils import launch
from course_utils.train.common import profile_config
from tests.test_data import write_cifar100

REPO = Path(__file__).resolve().parents[1]
# make test-floor runs these on the oldest torch too: torchrun, FSDP2 and DCP in the training scripts
pytestmark = [pytest.mark.floor, pytest.mark.multiprocess]


def test_ddp_script_runs_under_launch_on_real_cifar100(runs_root, tmp_path):
    data = tmp_path / "data"
    write_cifar100(data, n=128)
    job = tmp_path / "job"
    launch(
        str(REPO / "train" / "ddp.py"),
        2,
        argv=["--size", "ci", "--data-dir", str(data), "--no-verify", "--epochs", "2",
              "--profile", "1,0,1", "--job-dir", str(job)],
        echo=False,
        timeout=240,
    )  # fmt: skip
    r = json.loads((job / "result.json").read_text())
    assert r["source"] == "launch" and r["world_size"] == 2
    assert not r["synthetic"] and "CIFAR100" in r["data"] and "128 images" in r["data"]
    assert r["steps"] == 2 * (128 // 64)  # the ci size's global batch is 64
    assert len(r["traces"]) == 2 and all(Path(t).exists() for t in r["traces"])
    assert {json.loads(f.read_text())["rank"] for f in (job / "ranks").glob("*.json")} == {0, 1}
    lines = (job / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_profile_schedule_is_read_or_refused_clearly():
    c = profile_config("2,1,3")
    assert (c.wait, c.warmup, c.active) == (2, 1, 3)
    assert profile_config("off") is None
    with pytest.raises(SystemExit, match="WAIT,WARMUP,ACTIVE"):
        profile_config("3")


def test_amp_on_cpu_is_bfloat16_autocast_and_trains(runs_root, tmp_path):
    job = tmp_path / "job"
    launch(
        str(REPO / "train" / "ddp.py"),
        2,
        argv=["--size", "ci", "--epochs", "1", "--amp", "on", "--profile", "off",
              "--job-dir", str(job)],
        echo=False,
        timeout=240,
    )  # fmt: skip
    r = json.loads((job / "result.json").read_text())
    assert r["amp"] == "bfloat16"
    assert all(x == x and x < 10 for x in r["losses"])  # finite, not diverged


def test_hand_started_torchrun_without_rdzv_id_gets_a_fresh_job_dir(tmp_path):
    """torchrun on several nodes without --rdzv-id names every job "none": a second job must not
    resume the first one's checkpoint from runs/torchrun-none."""
    import argparse

    import torch

    from course_utils.launcher.context import RankContext
    from course_utils.train.common import job_dir

    ctx = RankContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
        run_dir=tmp_path / "torchrun-none",
    )  # fmt: skip
    first = job_dir(ctx, argparse.Namespace(job_dir=None))
    assert first != tmp_path / "torchrun-none" and first.name.startswith("torchrun-none-")
    assert (first / "ranks" / "rank0.json").exists()
    named = job_dir(ctx, argparse.Namespace(job_dir=str(tmp_path / "mine")))
    assert named == tmp_path / "mine"


def run_ddp_script(job: Path, *args: str) -> dict:
    launch(
        str(REPO / "train" / "ddp.py"),
        2,
        argv=["--size", "ci", "--profile", "off", "--job-dir", str(job), *args],
        echo=False,
        timeout=240,
    )
    return json.loads((job / "result.json").read_text())


def test_a_resumed_job_trains_exactly_as_one_that_never_stopped(runs_root, tmp_path):
    """Epoch 1 then a resume to epoch 2 gives the same losses, bit for bit, as 2 epochs in one go:
    the checkpoint carries model, optimizer, epoch and every rank's random state (the crops and
    flips of augmentation), and the sampler reshuffles by epoch. A crashed job's metrics lines
    past its last checkpoint are dropped on resume."""
    data = tmp_path / "data"
    write_cifar100(data, n=256)  # real files: torchvision's random crops and flips apply
    real = ("--data-dir", str(data), "--no-verify")
    straight = run_ddp_script(tmp_path / "straight", "--epochs", "2", *real)
    assert not straight["synthetic"]
    job = tmp_path / "resumed"
    run_ddp_script(job, "--epochs", "1", *real)
    with open(job / "metrics.jsonl", "a") as f:  # a step the crashed job logged, never saved
        f.write(json.dumps({"step": 99, "epoch": 1, "loss": 0.0}) + "\n")
    resumed = run_ddp_script(job, "--epochs", "2", *real)
    assert resumed["start_epoch"] == 1
    assert resumed["losses"] == straight["losses"]
    steps = [json.loads(x)["step"] for x in (job / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, straight["steps"] + 1))


def test_a_job_stopped_mid_epoch_resumes_at_that_batch_exactly(runs_root, tmp_path):
    """A STOP file in the job dir (what slurm_templates/requeue.sbatch writes on SIGUSR1): both
    ranks checkpoint after the next step, inside epoch 0, and return without a result; the next
    run skips the batches already trained (drawing their crops and flips again), puts back the
    random states of the stop and ends with the losses of a run that never stopped."""
    import torch

    data = tmp_path / "data"
    write_cifar100(data, n=256)  # real files: the skipped batches draw random crops and flips
    real = ("--data-dir", str(data), "--no-verify", "--epochs", "2")
    straight = run_ddp_script(tmp_path / "straight", *real)
    job = tmp_path / "stopped"
    job.mkdir()
    (job / "STOP").touch()
    launch(str(REPO / "train" / "ddp.py"), 2, echo=False, timeout=240,
           argv=["--size", "ci", "--profile", "off", "--job-dir", str(job), *real])  # fmt: skip
    assert not (job / "STOP").exists() and not (job / "result.json").exists()
    state = torch.load(job / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["batch"], state["step"]) == (0, 1, 1)
    resumed = run_ddp_script(job, *real)
    assert resumed["start_step"] == 1 and resumed["losses"] == straight["losses"]


def mean_of_ranks(ctx):
    import torch

    from course_utils.train.common import global_mean

    return global_mean(torch.tensor(float(ctx.rank + 1), device=ctx.device), ctx)


def test_the_logged_loss_is_the_mean_over_ranks(runs_root):
    """Each rank's loss is the mean over its shard; the global batch's loss is their mean (equal
    shards), never their sum: 1, 2 and 3 on three ranks log 2."""
    assert launch(mean_of_ranks, 3, echo=False).results == [2.0, 2.0, 2.0]


def recording_worker(ctx, job, epochs=2):
    """train/ddp.py's own main(), with its training set wrapped to record which samples each rank
    reads, in order."""
    import torch

    from course_utils.train import ddp

    seen = []
    real = ddp.load_dataset

    class Recording(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            seen.append(int(i))
            return self.inner[i]

    def load(*args, **kwargs):
        loaded = real(*args, **kwargs)
        if kwargs.get("train", True):
            loaded.dataset = Recording(loaded.dataset)
        return loaded

    ddp.load_dataset = load
    ddp.main(["--size", "ci", "--epochs", str(epochs), "--workers", "0", "--profile", "off",
              "--job-dir", job])  # fmt: skip
    return seen


def test_every_epoch_reshuffles_and_every_rank_reads_its_own_shard(runs_root, tmp_path):
    """DistributedSampler.set_epoch: the order changes from epoch to epoch (the same on every rank),
    and within an epoch the ranks read disjoint shards that together cover the data."""
    from course_utils.sizes import get_size

    ci = get_size("ci")
    res = launch(recording_worker, 2, job=str(tmp_path / "job"), echo=False, timeout=240)
    per_epoch = ci.train_samples // 2  # the samples one rank reads in one epoch (drop_last)
    epochs = [[seen[e * per_epoch : (e + 1) * per_epoch] for e in range(2)] for seen in res.results]
    assert all(len(seen) == 2 * per_epoch for seen in res.results)
    for rank in range(2):
        assert epochs[rank][0] != epochs[rank][1], f"rank {rank} read epoch 1 in epoch 0's order"
        assert sorted(epochs[rank][0]) != sorted(range(per_epoch))  # shuffled, not a plain prefix
    for e in range(2):
        a, b = set(epochs[0][e]), set(epochs[1][e])
        assert not a & b, f"epoch {e}: ranks 0 and 1 read {len(a & b)} samples twice"
        assert a | b == set(range(ci.train_samples))
