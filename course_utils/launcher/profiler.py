"""``launch(profile=...)``: a per-rank ``torch.profiler`` session around the worker.

``launch(worker, n, profile=ProfileConfig(active=3))`` gives every rank a
``torch.profiler`` session around the worker; the worker marks the end of
each training step with ``ctx.step()`` (a no-op when not profiling, so the
same worker runs either way). Each rank writes one Kineto/Chrome trace::

    run_dir/traces/rank{r}.steps{a}-{b}.pt.trace.json      (Perfetto, chrome://tracing)
    run_dir/tensorboard/rank{r}.*.pt.trace.json             (TensorBoard's profiler layout)

Clocks: ranks on one node share a clock. For several nodes, every rank passes a
barrier at the end of the last warm-up step and records a
``course_utils::clock_marker`` event as the first active step begins;
:func:`course_utils.profiling.trace.align` lines the ranks up on it. The
barrier's wait falls in the warm-up step, so no recorded step pays for it.
Taught in notebook 04.
"""

from __future__ import annotations

import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule

MARKER = "course_utils::clock_marker"


@dataclass(frozen=True)
class ProfileConfig:
    """Which steps to record and what to record about them."""

    wait: int = 1
    """Steps at the start that are not profiled at all (start-up effects)."""
    warmup: int = 1
    """Steps profiled but thrown away (the profiler's own start-up cost)."""
    active: int = 3
    """Steps recorded into the trace."""
    record_shapes: bool = False
    """Record input shapes of every op (bigger traces)."""
    profile_memory: bool = False
    """Record allocations and frees (memory timeline)."""
    with_stack: bool = False
    """Record Python stacks of every op (much bigger traces, slower)."""
    tensorboard: bool = True
    """Also write the trace in TensorBoard's profiler layout under ``run_dir/tensorboard``."""
    align_clocks: bool = True
    """Barrier + marker at the first active step, for aligning ranks across nodes."""

    def __post_init__(self):
        if self.wait < 0 or self.warmup < 0 or self.active < 1:
            raise ValueError(
                f"ProfileConfig needs wait >= 0, warmup >= 0 and active >= 1; got wait={self.wait}, "
                f"warmup={self.warmup}, active={self.active}"
            )

    @property
    def steps_needed(self) -> int:
        """How many ``ctx.step()`` calls complete the recording."""
        return self.wait + self.warmup + self.active


class RankProfiler:
    """One rank's profiler session; ``step()`` is what ``ctx.step()`` calls."""

    def __init__(self, config: ProfileConfig, rank: int, run_dir: Path, device: torch.device):
        self.config, self.rank, self.run_dir = config, rank, Path(run_dir)
        self.trace_dir = self.run_dir / "traces"
        self.trace_dir.mkdir(exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.first_active = config.wait + config.warmup
        self.steps = 0
        self.path = (
            self.trace_dir
            / f"rank{rank}.steps{self.first_active}-{self.first_active + config.active - 1}.pt.trace.json"
        )
        self.prof = profile(
            activities=activities,
            schedule=schedule(
                wait=config.wait, warmup=config.warmup, active=config.active, repeat=1
            ),
            on_trace_ready=self._export,
            record_shapes=config.record_shapes,
            profile_memory=config.profile_memory,
            with_stack=config.with_stack,
        )

    def _export(self, prof) -> None:
        prof.export_chrome_trace(
            str(self.path)
        )  # Kineto saves a trace once: copy it for TensorBoard
        if self.config.tensorboard:
            # the name torch.profiler.tensorboard_trace_handler gives: <worker>.<ms>.pt.trace.json
            tb_dir = self.run_dir / "tensorboard"
            tb_dir.mkdir(exist_ok=True)
            shutil.copyfile(
                self.path, tb_dir / f"rank{self.rank}.{int(time.time() * 1000)}.pt.trace.json"
            )

    def _aligning(self) -> bool:
        return self.config.align_clocks and dist.is_available() and dist.is_initialized()

    def _marker(self) -> None:
        """A zero-length event every rank records right after the same barrier."""
        if self._aligning():
            with record_function(MARKER):
                pass

    def __enter__(self) -> RankProfiler:
        warnings.filterwarnings(
            "ignore", message=".*Profiler clears events at the end of each cycle.*"
        )
        if self.first_active == 0 and self._aligning():
            dist.barrier()  # before recording starts: the wait is not part of step 0
        self.prof.__enter__()
        if self.first_active == 0:
            self._marker()
        return self

    def step(self) -> None:
        if self.steps + 1 == self.first_active and self._aligning():
            dist.barrier()  # still in the warm-up step: the first recorded step does not pay it
        self.prof.step()
        self.steps += 1
        if self.steps == self.first_active:
            self._marker()

    def __exit__(self, *exc) -> None:
        self.prof.__exit__(*exc)
