"""What every training script shares: arguments, the job directory, checkpoints, staging, logs.

The job directory holds everything one job writes::

    <job dir>/
        checkpoint.pt       rank 0 only, written atomically; loaded with weights_only=True
        STOP                a request to checkpoint and stop (StopRequest); removed when served
        metrics.jsonl       one line per step (rank 0): step, epoch, global-batch loss
        result.json         rank 0 at the end: ranks and hosts, losses, accuracy, traces
        ranks/rank<r>.json  each rank at start-up: its host, pid and device
        traces/             one profiler trace per rank (Perfetto / chrome://tracing)
        tensorboard/        the same traces in TensorBoard's layout

It defaults to ``runs/<source>-<job id>`` (``runs/slurm-12345``); pass ``--job-dir`` to resume a
job in the same place. The per-rank logs are the scheduler's (``srun --output``) or launch's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_utils.launcher.context import RankContext
from course_utils.launcher.profiler import ProfileConfig, RankProfiler
from course_utils.sizes import PRESETS, get_size

CHECKPOINT = "checkpoint.pt"
STOP_FILE = "STOP"
STOPPED = 75  # a rank's exit status after it checkpointed and stopped on request (EX_TEMPFAIL)


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every training script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--size",
        choices=sorted(PRESETS),
        default=None,
        help="problem size (default: $COURSE_SIZE, else gpu with CUDA, else cpu)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="staged datasets (default: $COURSE_DATA_DIR); absent files: a labelled synthetic set",
    )
    p.add_argument(
        "--stage-to",
        default=None,
        help="copy --data-dir to this node-local folder first (local rank 0 of each node); "
        "{host} in it becomes the node's name",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="accept staged files whose checksums differ from the official release",
    )
    p.add_argument("--job-dir", default=None, help="where this job writes (default: runs/<job>)")
    p.add_argument("--epochs", type=int, default=None, help="default: the size's epochs")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument(
        "--profile",
        default="1,1,3",
        metavar="WAIT,WARMUP,ACTIVE",
        help="torch.profiler schedule in steps; 'off' records nothing",
    )
    p.add_argument(
        "--backend", default="auto", choices=["auto", "gloo", "nccl"], help="default: nccl on GPUs"
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def size_of(args):
    return get_size(args.size)


def profile_config(spec: str) -> ProfileConfig | None:
    """``"1,1,3"`` -> ``ProfileConfig(wait=1, warmup=1, active=3)``; ``"off"`` -> ``None``."""
    if spec.lower() in ("off", "none", "0", ""):
        return None
    try:
        wait, warmup, active = (int(v) for v in spec.split(","))
    except ValueError:
        raise SystemExit(
            f"--profile takes WAIT,WARMUP,ACTIVE (three whole numbers, e.g. 1,1,3) or 'off'; "
            f"got {spec!r}"
        ) from None
    return ProfileConfig(wait=wait, warmup=warmup, active=active)


def job_dir(ctx: RankContext, args) -> Path:
    """``--job-dir``, else the run directory :func:`course_utils.dist.init` chose.

    ``torchrun`` started by hand on several nodes without ``--rdzv-id`` names every job ``none``:
    rank 0 then picks a fresh folder for this job, so it never resumes another job's checkpoint.
    """
    path = Path(args.job_dir) if args.job_dir else Path(ctx.run_dir)
    if not args.job_dir and path.name in ("torchrun-none", "torchrun-"):
        fresh = [f"{path}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(fresh, src=0)
        path = Path(fresh[0])
    if ctx.rank == 0:
        (path / "ranks").mkdir(parents=True, exist_ok=True)
    barrier(ctx)
    # which process and host is which rank: the first thing to look at when a job hangs
    (path / "ranks" / f"rank{ctx.rank}.json").write_text(json.dumps(where(ctx)))
    return path


def barrier(ctx: RankContext) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


def stage_locally(ctx: RankContext, src: str | Path | None, dst: str | Path) -> Path:
    """Copy the staged data to node-local storage: local rank 0 *of every node* copies, then all
    ranks wait. (Rank 0 alone would fill only the first node's disk: the other nodes' ranks would
    read an empty folder.)"""
    dst = Path(str(dst).replace("{host}", socket.gethostname()))
    if src is None:
        raise SystemExit(
            "--stage-to needs --data-dir (or $COURSE_DATA_DIR): what should be copied?"
        )
    if ctx.local_rank == 0 and not (dst / ".staged").exists():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        (dst / ".staged").write_text(f"from {src} at {time.ctime()}\n")
    barrier(ctx)
    return dst


def same_data_everywhere(ctx: RankContext, loaded) -> None:
    """Fail, naming the ranks, if ranks loaded different data (a node whose staged copy is missing
    falls back to the synthetic set): mismatched datasets mean mismatched step counts, a hang."""
    everyone = gather((loaded.name, loaded.synthetic, len(loaded.dataset), socket.gethostname()))
    kinds = {e[:3] for e in everyone}
    if len(kinds) > 1:
        lines = [
            f"  rank {r} on {host}: {name}, {'SYNTHETIC' if synth else 'real'}, {n} images"
            for r, (name, synth, n, host) in enumerate(everyone)
        ]
        raise SystemExit(
            "ranks loaded different data; every rank must read the same staged files "
            "(check --data-dir / --stage-to on every node):\n" + "\n".join(lines)
        )


def save_checkpoint(ctx: RankContext, folder: Path, state: dict) -> Path | None:
    """Rank 0 writes ``state`` (tensors, numbers, strings, lists, dicts) to ``checkpoint.pt``:
    to a temporary name first, then renamed, so a job killed mid-write leaves the last good one."""
    path = folder / CHECKPOINT
    if ctx.rank == 0:
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    barrier(ctx)
    return path if ctx.rank == 0 else None


def load_checkpoint(folder: Path, device: torch.device) -> dict | None:
    """The job's checkpoint, or ``None``. ``weights_only=True``: a checkpoint is data, never code."""
    path = folder / CHECKPOINT
    if not path.exists():
        return None
    return torch.load(path, map_location=device, weights_only=True)


class StopRequest:
    """A request to checkpoint and stop, seen by every rank after the same step.

    Two ways in: the file ``<job dir>/STOP``, which rank 0 looks for after every step
    (``slurm_templates/requeue.sbatch`` touches it when SLURM warns of the time limit; a person
    can too), and SIGUSR1 on any rank (ranks started by ``srun``: ``scancel --signal=USR1 JOB``).
    The signal handler only sets a flag; the work happens at the step boundary.

    :meth:`requested` is a collective: every rank's flag goes through an all-reduce (MAX), so all
    ranks stop after the same step or none does. A rank that stopped alone would leave the others
    waiting in their next all-reduce until the timeout. After the checkpoint, :meth:`served`
    removes the file: the batch script reads its absence as "the checkpoint is written".
    """

    def __init__(self, ctx: RankContext, folder: Path, signals=(signal.SIGUSR1,)):
        self.ctx, self.path, self.signalled = ctx, Path(folder) / STOP_FILE, False
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for s in signals:
                self.previous[s] = signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def requested(self) -> bool:
        """Does any rank see a request? Every rank calls it after every step."""
        mine = self.signalled or (self.ctx.rank == 0 and self.path.exists())
        flag = torch.tensor([float(mine)], device=self.ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def served(self) -> None:
        """Rank 0 removes the request once the checkpoint is written (every rank calls it)."""
        if self.ctx.rank == 0:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def where(ctx: RankContext) -> dict:
    """This rank's place in the job, gathered by rank 0 into ``result.json``."""
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "host": socket.gethostname(),
        "device": str(ctx.device),
        "pid": os.getpid(),
    }


def gather(value) -> list:
    """Every rank's ``value``, in rank order (``[value]`` without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_where(ctx: RankContext) -> list[dict]:
    return gather(where(ctx))


def global_mean(value: torch.Tensor, ctx: RankContext) -> float:
    """The mean of a per-rank scalar over all ranks (the global batch's loss)."""
    t = value.detach().float().reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def gather_rng(ctx: RankContext) -> list[dict]:
    """Every rank's random number generator states (CPU, and the rank's GPU), for the checkpoint:
    a resumed job draws the same crops, flips and dropout masks as an uninterrupted one."""
    mine = {"cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return [{k: v.cpu() for k, v in r.items()} for r in gather(mine)]


def restore_rng(ctx: RankContext, states: list[dict] | None) -> None:
    """Put back this rank's generator states from :func:`gather_rng` (same number of ranks only)."""
    if not states:
        return
    if len(states) != ctx.world_size:
        if ctx.rank == 0:
            print(
                f"the checkpoint has random states for {len(states)} ranks, this job "
                f"{ctx.world_size}: training continues, with different random draws",
                flush=True,
            )
        return
    torch.set_rng_state(states[ctx.rank]["cpu"].cpu())
    if ctx.device.type == "cuda" and "cuda" in states[ctx.rank]:
        torch.cuda.set_rng_state(states[ctx.rank]["cuda"].cpu(), ctx.device)


class Metrics:
    """Rank 0 appends one JSON line per step to ``metrics.jsonl``.

    ``after_step``: the step a resumed job starts after; lines past it (written by the job that
    crashed after its last checkpoint) are dropped, so every step appears once."""

    def __init__(self, ctx: RankContext, folder: Path, after_step: int = 0):
        self.file = None
        if ctx.rank != 0:
            return
        path = folder / "metrics.jsonl"
        if path.exists():
            keep = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= after_step
            ]
            path.write_text("".join(line + "\n" for line in keep))
        self.file = open(path, "a")  # noqa: SIM115 - closed by close()

    def log(self, **row) -> None:
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


class Profiler:
    """The profiler schedule of notebook 04 outside ``launch``: ``step()`` after every step."""

    def __init__(self, ctx: RankContext, folder: Path, config: ProfileConfig | None):
        self.inner = RankProfiler(config, ctx.rank, folder, ctx.device) if config else None
        self.done = 0
        self.config = config

    def __enter__(self):
        if self.inner:
            self.inner.__enter__()
        return self

    def step(self) -> None:
        if self.inner and self.done < self.config.steps_needed:
            self.inner.step()
            self.done += 1
            if self.done == self.config.steps_needed:
                self.inner.__exit__(None, None, None)

    def __exit__(self, *exc) -> None:
        if self.inner and self.done < self.config.steps_needed:
            self.inner.__exit__(*exc)

    @property
    def trace(self) -> str | None:
        if self.inner and self.done >= self.config.steps_needed and self.inner.path.exists():
            return str(self.inner.path)
        return None


def write_result(ctx: RankContext, folder: Path, result: dict) -> None:
    """Rank 0 writes ``result.json``; every rank returns after it is written."""
    if ctx.rank == 0:
        tmp = folder / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, folder / "result.json")
    barrier(ctx)


def close(ctx: RankContext) -> None:
    """The end of a script's process group: left to the process's exit, on purpose.

    Every rank has passed the final barrier, so no collective is pending. The process ends right
    after (:func:`exit_now` under ``torchrun`` or ``srun``, the launcher under ``launch``), which
    closes the group's sockets. ``destroy_process_group`` here hung now and then on torch 2.6 with
    gloo, and a rank destroying its group can wait on a store that rank 0's exit already took away
    (``srun`` alone: rank 0 serves it).
    """
    del ctx


def exit_now(result: dict | None = None) -> None:
    """End a script run by torchrun or srun once its results are written: ``os._exit(0)``, or
    ``os._exit(STOPPED)`` when ``result`` says the run stopped on request (:class:`StopRequest`).

    Gloo (and DTensor) threads still alive after ``destroy_process_group`` can abort a normally
    ending interpreter ("terminate called without an active exception", SIGABRT in about one run
    of five here), and torchrun or srun would report a finished job as failed. Under ``launch`` the
    launcher ends the rank the same way after saving its result, so this returns there.
    """
    if os.environ.get("COURSE_RUN_DIR"):
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STOPPED if result and result.get("stopped") else 0)
