"""What a rank knows about itself: the ``ctx`` every worker receives.

The same :class:`RankContext` is built by :func:`course_utils.launch` (notebook
ranks) and by :func:`course_utils.dist.init` (``torchrun`` / ``srun`` scripts),
so a worker written against it runs unchanged under all three.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cpus import threads_per_rank


@dataclass
class RankContext:
    """One rank's view of the job."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int
    """Number of ranks in the job."""
    local_rank: int
    """Rank within this node (``LOCAL_RANK``). With one GPU per rank it is also the GPU's index;
    use :attr:`device`, which is right also when ranks share GPUs."""
    device: torch.device
    """Where this rank computes: its GPU (``cuda:i``) with NCCL, ``cpu`` with gloo. Pass it to
    ``.to()``, ``torch.cuda.set_device`` and ``DistributedDataParallel(device_ids=[ctx.device])``."""
    backend: str
    """The torch.distributed backend: ``"nccl"`` or ``"gloo"``."""
    run_dir: Path
    """Folder shared by all ranks of this run: logs, results, traces."""
    local_world_size: int = 1
    """Ranks on this node."""
    init_method: str | None = None
    """URL for a hand-written ``init_process_group`` (``file://...`` under launch)."""
    extras: dict = field(default_factory=dict)
    """Free-form per-run values other course_utils modules attach."""
    on_step: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Called by :meth:`step`; set by ``launch(profile=...)`` to drive the profiler."""
    steps_done: int = field(default=0, compare=False)
    """How many times :meth:`step` was called."""
    steps_total: int | None = field(default=None, compare=False)
    """The number of steps the worker announced (``ctx.step(total=n)``), for the progress display."""
    status: StatusFile | None = field(default=None, repr=False, compare=False)
    """Where this rank reports its state to ``launch``'s progress display (``None`` elsewhere)."""

    def step(self, total: int | None = None) -> None:
        """Mark the end of one training step (``total``: how many steps the worker will run).

        Drives the profiler under ``launch(..., profile=...)`` and the per-rank progress display
        ("step 3 of 10"); elsewhere it only counts, so a worker can always call it.
        """
        self.steps_done += 1
        if total is not None:
            self.steps_total = total
        if self.on_step is not None:
            self.on_step()
        if self.status is not None:
            self.status.write("step", self.steps_done, self.steps_total)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints summaries and writes checkpoints."""
        return self.rank == 0

    def print0(self, *args, **kwargs) -> None:
        """``print`` on rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs)

    def path(self, name: str) -> Path:
        """A file name in the run dir, tagged with this rank: ``path("loss.pt")`` -> ``rank1.loss.pt``."""
        return self.run_dir / f"rank{self.rank}.{name}"


class StatusFile:
    """One rank's state for the launcher's progress display: ``rank{r}.status`` in the run dir.

    A line ``state step total``, replaced atomically; step updates at most five times a second.
    """

    def __init__(self, path: Path):
        self.path, self.last_step = Path(path), 0.0

    def write(self, state: str, step: int = 0, total: int | None = None) -> None:
        if state == "step":
            now = time.monotonic()
            if now - self.last_step < 0.2 and step != total:
                return
            self.last_step = now
        tmp = self.path.with_suffix(".status.tmp")
        tmp.write_text(f"{state} {step} {total if total is not None else -1}")
        os.replace(tmp, self.path)


def read_status(path: Path) -> tuple[str, int, int | None] | None:
    """``(state, step, total)`` from a :class:`StatusFile`, or ``None`` before the first write."""
    try:
        state, step, total = Path(path).read_text().split()
    except (FileNotFoundError, ValueError):
        return None
    return state, int(step), None if int(total) < 0 else int(total)


def cpu_threads_per_rank(local_world_size: int) -> int:
    """Usable cores (affinity mask and cgroup CPU quota, :mod:`course_utils.cpus`), split evenly
    between the ranks on the node (at least 1)."""

    return threads_per_rank(local_world_size)
