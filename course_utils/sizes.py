"""Problem sizes: one switch for every notebook and workload.

``ci`` is tiny (seconds, for nbval on 2 CPU cores), ``cpu`` is meaningful on a
laptop, ``gpu`` is the full course. ``COURSE_SIZE`` picks one; otherwise the size
follows where the ranks will run: ``gpu`` when ``launch`` would put them on GPUs
(one each, or sharing GPUs through NCCL >= 2.30), ``cpu`` when they would run as CPU
processes, whatever ``torch.cuda.is_available()`` says. Four CPU ranks with the
``gpu`` preset's work (50,000 images, 256 MiB collectives) would look hung.

This module is below the launcher and imports nothing from it: the size takes the placement as
an argument, and without one it asks the planner the launcher registers when it is imported
(:func:`use_placement`; ``import course_utils`` imports the launcher)::

    from course_utils.sizes import get_size
    size = get_size()          # Size(name='cpu', ...)
    size = get_size(ranks=8)   # for a notebook that starts 8 ranks
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

SIZE_ENV = "COURSE_SIZE"


_MINIMUM = {"warmup_steps": 0, "num_workers": 0, "max_message_bytes": 1024}
"""Smallest allowed value per field; every other count must be at least 1."""


@dataclass(frozen=True)
class Size:
    """Problem sizes shared by every notebook."""

    name: str
    """``"ci"``, ``"cpu"`` or ``"gpu"``."""
    train_samples: int
    """Training images used per epoch (a prefix of the dataset)."""
    test_samples: int
    """Test images used for evaluation."""
    batch_size: int
    """Global batch size (split across ranks in the data-parallel notebooks)."""
    epochs: int
    """Epochs of the baseline training run in notebook 01."""
    width: int
    """Channels of the first ResNet stage (the model doubles them per stage)."""
    bench_steps: int
    """Timed steps per configuration in throughput measurements (after warm-up)."""
    warmup_steps: int
    """Untimed steps before timing (allocator, cuDNN autotune, compile)."""
    world_size: int
    """Ranks the multi-rank demos start by default."""
    num_workers: int
    """DataLoader worker processes in the data-loading experiments (0 = load in the main process)."""
    compile: bool
    """Whether notebooks try ``torch.compile`` (slow to compile on small CPU nodes)."""
    max_message_bytes: int
    """Largest message in the collective benchmarks."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Size needs a non-empty name, got {self.name!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                continue
            if f.name == "compile":
                if not isinstance(value, bool):
                    raise ValueError(
                        f"Size {self.name!r}: compile must be True or False, got {value!r}"
                    )
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(
                    f"Size {self.name!r}: {f.name} must be a whole number, got {value!r}"
                )
            low = _MINIMUM.get(f.name, 1)
            if value < low:
                raise ValueError(f"Size {self.name!r}: {f.name} must be >= {low}, got {value}")
        if self.batch_size > self.train_samples:
            raise ValueError(
                f"Size {self.name!r}: batch_size={self.batch_size} exceeds train_samples={self.train_samples}"
            )
        if self.batch_size % self.world_size:
            raise ValueError(
                f"Size {self.name!r}: batch_size={self.batch_size} is the global batch and must split "
                f"evenly over world_size={self.world_size} ranks"
            )

    def asdict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Size] = {
    "ci": Size(
        "ci",
        train_samples=1024,
        test_samples=256,
        batch_size=64,
        epochs=3,
        width=8,
        bench_steps=3,
        warmup_steps=1,
        world_size=2,
        num_workers=0,
        compile=False,
        max_message_bytes=1 << 20,
    ),
    "cpu": Size(
        "cpu",
        train_samples=8192,
        test_samples=2048,
        batch_size=128,
        epochs=3,
        width=16,
        bench_steps=10,
        warmup_steps=2,
        world_size=2,
        num_workers=2,
        compile=False,
        max_message_bytes=16 << 20,
    ),
    "gpu": Size(
        "gpu",
        train_samples=50000,
        test_samples=10000,
        batch_size=256,
        epochs=5,
        width=64,
        bench_steps=50,
        warmup_steps=10,
        world_size=4,
        num_workers=4,
        compile=True,
        max_message_bytes=256 << 20,
    ),
}


# Where a plain ``launch`` would put n ranks (course_utils.launcher.place_ranks): the launcher
# registers it on import, so that this bottom layer never imports the launcher (issue 39).
_placement_of: Callable[[int], Any] | None = None


def use_placement(placement_of: Callable[[int], Any]) -> None:
    """Register ``placement_of(ranks)``: where a plain ``launch`` of that many ranks would run
    (anything with ``device_type`` and ``describe()``). The launcher calls it when imported."""
    global _placement_of
    _placement_of = placement_of


def _placed(ranks: int, placement):
    if placement is not None:
        return placement
    if _placement_of is None:  # only if this module were imported without its package
        raise RuntimeError("no placement: import course_utils (its launcher registers one)")
    return _placement_of(ranks)


def default_size_name(ranks: int | None = None, placement=None) -> str:
    """``$COURSE_SIZE`` if set; else ``gpu`` when ``ranks`` ranks of a plain ``launch`` would run
    on GPUs, ``cpu`` when they would run on the CPU. ``ranks`` defaults to the ``gpu`` preset's
    ``world_size``; a single-process notebook passes 1. ``placement``: where they would run
    (default: the launcher's plan for them)."""
    return size_choice(ranks, placement)[0]


def size_choice(ranks: int | None = None, placement=None) -> tuple[str, str]:
    """``(size name, why)``: the size :func:`get_size` picks for a notebook of ``ranks`` ranks
    (``None``: as many as the ``gpu`` preset starts)."""
    env = os.environ.get(SIZE_ENV)
    if env:
        return env, f"{SIZE_ENV}={env}"
    n = ranks or PRESETS["gpu"].world_size
    on_gpu = _placed(n, placement).device_type == "cuda"
    if n == 1:
        return ("gpu", "training runs on a GPU") if on_gpu else ("cpu", "training runs on the CPU")
    who = f"the {n} ranks" if ranks else f"{n} ranks, as many as the 'gpu' size starts,"
    return ("gpu", f"{who} run on GPUs") if on_gpu else ("cpu", f"{who} would run on the CPU")


def get_size(name: str | None = None, *, ranks: int | None = None, placement=None) -> Size:
    """The preset called ``name`` (default: :func:`default_size_name` for ``ranks`` ranks)."""
    name = name or default_size_name(ranks, placement)
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown size {name!r}: choose one of {sorted(PRESETS)} (env {SIZE_ENV})"
        ) from None


def hardware_line(ranks: int, size: Size | None = None, chosen_for: int | None = None) -> str:
    """The notebooks' hardware line: where ``ranks`` ranks run and why, then the size and why.

    ``chosen_for``: the ``ranks`` the notebook passed to :func:`get_size` (``None``: the default).
    """
    choice = size_choice(chosen_for)
    size = size or get_size(choice[0])
    return f"{_placed(ranks, None).describe()}. {size_line(size, choice)}."


def size_line(size: Size, choice: tuple[str, str]) -> str:
    """The size half of the notebooks' hardware line: ``choice`` is :func:`size_choice`'s answer."""
    name, why = choice
    return (
        f"size '{size.name}' ({why}; {SIZE_ENV}=ci|cpu|gpu to change)"
        if size.name == name
        else f"size '{size.name}' (chosen by the notebook)"
    )
