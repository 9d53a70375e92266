"""Rank set-up for scripts: the same ``ctx`` under ``launch``, ``torchrun`` and ``srun``.

A training script written like this runs unchanged in all three::

    from course_utils import dist as cdist

    with cdist.session() as ctx:          # init_process_group from the environment
        model = Net().to(ctx.device)
        ...
        cdist.print0("done")

    torchrun --standalone --nproc-per-node 4 train.py
    srun --ntasks-per-node 4 python train.py           # SLURM_* variables
    python -c "from course_utils import launch; launch('train.py', 4)"
    python train.py                                    # one process, world_size 1
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .launcher import placement
from .launcher.context import RankContext, cpu_threads_per_rank


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job, as read from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    """``"launch"``, ``"torchrun"``, ``"slurm"`` or ``"single"``."""
    job_id: str


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[07-09,12],login1"`` -> ``"gpu07"``."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not head:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    if not head.group(2):
        return head.group(1)
    first = head.group(3).split(",")[0].split("-")[0]
    return head.group(1) + first


def _tasks_on_first_node(value: str) -> int:
    """``SLURM_TASKS_PER_NODE`` looks like ``"4(x2),3"``; the first count is ours on node 0."""
    return int(re.match(r"\d+", value).group(0))


def read_topology(env: Mapping[str, str] | None = None) -> Topology:
    """Read rank and rendezvous from torchrun (or launch) variables, else SLURM's, else one process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return Topology(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            source="launch" if "COURSE_RUN_DIR" in env else "torchrun",
            job_id=env.get("TORCHELASTIC_RUN_ID", env.get("SLURM_JOB_ID", "local")),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = env.get("SLURM_JOB_ID", "0")
        per_node = (
            env.get("SLURM_NTASKS_PER_NODE")
            or env.get("SLURM_STEP_TASKS_PER_NODE")
            or env.get("SLURM_TASKS_PER_NODE")
            or env["SLURM_NTASKS"]
        )
        addr = env.get("MASTER_ADDR") or first_host(
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        )
        # No fixed port: derive one from the job id so concurrent jobs on a node differ.
        port = int(env.get("MASTER_PORT") or 20000 + int(re.sub(r"\D", "", job) or 0) % 20000)
        return Topology(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=_tasks_on_first_node(per_node),
            master_addr=addr,
            master_port=port,
            source="slurm",
            job_id=job,
        )
    return Topology(0, 1, 0, 1, "127.0.0.1", 0, "single", "local")


def _pick_device(topo: Topology, backend: str) -> tuple[str, torch.device, dict[str, str]]:
    """(backend, this rank's device, variables to set) for the ranks on this node, placed as
    ``launch`` places them (:mod:`course_utils.launcher.placement`): one GPU each, GPUs shared
    round-robin through NCCL >= 2.30, or CPU processes with gloo."""
    placed = os.environ.get("COURSE_DEVICE")  # under launch: the launcher already placed us
    if (
        placed
        and "COURSE_RUN_DIR" in os.environ
        and backend in ("auto", os.environ.get("COURSE_BACKEND"))
    ):
        return os.environ.get("COURSE_BACKEND", "gloo"), torch.device(placed), {}
    where = placement.place_ranks(
        topo.local_world_size,
        "auto" if backend == "auto" else backend,
        "cuda" if backend == "nccl" else "auto",
    )
    if topo.local_rank == 0 and (
        where.shared
        or (where.device_type == "cpu" and backend == "auto" and torch.cuda.is_available())
    ):
        print(f"course_utils.dist: {where.describe()}", flush=True)
    return where.backend, where.device(topo.local_rank), where.rank_env()


def init(backend: str = "auto", timeout_s: float = 1800.0) -> RankContext:
    """Initialise the default process group from the environment and return this rank's ``ctx``."""
    topo = read_topology()
    backend = os.environ.get("COURSE_BACKEND", backend) if backend == "auto" else backend
    backend, device, env = _pick_device(topo, backend)
    for name, value in env.items():  # NCCL reads them when the communicator is made
        os.environ.setdefault(name, value)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads_per_rank(topo.local_world_size))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run_dir = Path(
        os.environ.get("COURSE_RUN_DIR") or Path("runs") / f"{topo.source}-{topo.job_id}"
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    init_method = os.environ.get("COURSE_INIT_METHOD")
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if topo.source == "single":
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            if init_method is None:
                os.environ.setdefault("MASTER_ADDR", topo.master_addr)
                os.environ.setdefault("MASTER_PORT", str(topo.master_port))
                init_method = "env://"
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=topo.rank,
                world_size=topo.world_size,
                timeout=timeout,
            )
    return RankContext(
        rank=topo.rank,
        world_size=topo.world_size,
        local_rank=topo.local_rank,
        device=device,
        backend=backend,
        run_dir=run_dir,
        local_world_size=topo.local_world_size,
        init_method=init_method,
        extras={"source": topo.source},
    )


def cleanup() -> None:
    """Destroy the default process group if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def session(backend: str = "auto", timeout_s: float = 1800.0):
    """``with session() as ctx:``: :func:`init` on entry, :func:`cleanup` on exit."""
    ctx = init(backend, timeout_s)
    try:
        yield ctx
    finally:
        cleanup()


def get_rank() -> int:
    """This process's rank (0 when no process group is set up)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only, with ``flush=True`` so logs interleave in order."""
    if get_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
