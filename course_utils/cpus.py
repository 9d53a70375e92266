"""How many CPU cores this process may really use: the affinity mask and the cgroup CPU quota.

``os.cpu_count()`` counts the machine's cores. A process may use fewer:

- the **affinity mask** (``taskset``, SLURM's ``--cpus-per-task`` binding, a cpuset): the cores it
  may be scheduled on, ``os.sched_getaffinity(0)``;
- the **CPU quota** of its cgroup (Kubernetes' CPU limit on JupyterHub pods, Docker's ``--cpus``):
  CPU time per period, ``cpu.max`` (cgroup v2: ``"200000 100000"`` is 2 cores, ``"max 100000"`` no
  limit) or ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (cgroup v1, ``-1``: no limit). A pod
  limited to 2 cores on a 64-core node sees 64 cores everywhere, and 64 threads then share 2 cores'
  worth of time: the kernel throttles them, and a step takes many times longer.

The usable cores are the smaller of the two (a fractional quota rounded down, at least 1). The
launcher splits them between ranks (threads per rank), DataLoader workers per rank come from what
is left, and ``doctor`` reports all three numbers::

    python -c "from course_utils.cpus import cpu_report; print(cpu_report())"
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"
CGROUP = "/proc/self/cgroup"


def affinity_cores() -> int:
    """Cores this process may be scheduled on (``os.cpu_count()`` where there is no mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(root inside the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return out


def _own_paths(cgroup: str) -> tuple[dict[str, str], str | None]:
    """From ``/proc/self/cgroup``: {v1 controller: path} and the v2 path (``0::/path``)."""
    v1, v2 = {}, None
    for line in cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        for c in controllers.split(","):
            if c:
                v1[c] = path
    return v1, v2


def _dirs(mount_root: str, mount_point: str, path: str) -> list[Path]:
    """The process's cgroup folder and its ancestors up to the mount point (limits of every
    ancestor apply). Inside a container the mount's root is the container's own cgroup, so the
    path is taken relative to it; a path outside it means we cannot see ours: the mount point."""
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
    rel = "" if rel == "." else rel
    here = Path(mount_point) / rel if rel else Path(mount_point)
    out = [here]
    while here != Path(mount_point) and here.parent != here:
        here = here.parent
        out.append(here)
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_limit(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or 100000)
    except (ValueError, ZeroDivisionError):
        return None


def _v1_limit(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(mountinfo: str | None = None, cgroup: str | None = None) -> float | None:
    """Cores' worth of CPU time the cgroup quota allows (``1.5`` for a 1500m limit), or ``None``.

    ``mountinfo`` and ``cgroup`` are the texts of ``/proc/self/mountinfo`` and ``/proc/self/cgroup``
    (read from there by default; tests pass fake ones pointing at fake cgroup trees). A cgroup v1
    ``cpu`` controller wins over v2 (a hybrid host mounts both, and only one holds ``cpu``).
    """
    if mountinfo is None:
        mountinfo = _read(Path(MOUNTINFO)) or ""
    if cgroup is None:
        cgroup = _read(Path(CGROUP)) or ""
    v1, v2 = _own_paths(cgroup)
    limits = []
    for root, point, fstype, options in _mounts(mountinfo):
        if fstype == "cgroup" and "cpu" in options and "cpu" in v1:
            limits += [_v1_limit(d) for d in _dirs(root, point, v1["cpu"])]
    if not limits:
        for root, point, fstype, _ in _mounts(mountinfo):
            if fstype == "cgroup2" and v2 is not None:
                limits += [_v2_limit(d) for d in _dirs(root, point, v2)]
    found = [x for x in limits if x is not None]
    return min(found) if found else None


@dataclass(frozen=True)
class CpuBudget:
    """The cores a process may use, and where each limit comes from."""

    machine: int
    """``os.cpu_count()``: every core of the machine."""
    affinity: int
    """Cores in the affinity mask."""
    quota: float | None
    """Cores' worth of time the cgroup quota allows (``None``: no quota)."""

    @property
    def usable(self) -> int:
        """What to plan threads with: the smaller limit, a fractional quota rounded down, >= 1."""
        cores = self.affinity
        if self.quota is not None:
            cores = min(cores, max(1, math.floor(self.quota + 1e-9)))
        return max(1, cores)

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"a cgroup quota of {self.quota:g} cores"
        return (
            f"{self.usable} usable ({self.machine} in the machine, {self.affinity} in the affinity "
            f"mask, {quota})"
        )


def cpu_budget(mountinfo: str | None = None, cgroup: str | None = None) -> CpuBudget:
    """This process's :class:`CpuBudget` (texts as in :func:`cgroup_cpu_limit`, for tests)."""
    return CpuBudget(os.cpu_count() or 1, affinity_cores(), cgroup_cpu_limit(mountinfo, cgroup))


def usable_cores() -> int:
    """The cores threads should be planned for: affinity and quota both respected."""
    return cpu_budget().usable


def threads_per_rank(ranks_on_node: int, cores: int | None = None) -> int:
    """Usable cores split evenly between the ranks on this node (at least 1)."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, ranks_on_node))


def loader_workers(wanted: int, ranks_on_node: int, cores: int | None = None) -> int:
    """DataLoader workers per rank: at most ``wanted``, and no more than the rank's share of the
    usable cores leaves beside the rank itself (each worker is a process that wants a core)."""
    share = threads_per_rank(ranks_on_node, cores)
    return max(0, min(wanted, share - 1))


def cpu_report() -> str:
    return cpu_budget().describe()


__all__ = [
    "CpuBudget",
    "affinity_cores",
    "cgroup_cpu_limit",
    "cpu_budget",
    "cpu_report",
    "loader_workers",
    "threads_per_rank",
    "usable_cores",
]
