"""The course's problem size for where ``launch`` would put the ranks on this node.

:mod:`course_utils.sizes` holds the presets and the rule; this module plans the ranks
(:func:`.placement.plan`) and hands the placement to it, so ``sizes`` needs nothing from the
launcher. The notebooks import their size from here::

    from course_utils.launcher.sizing import get_size, hardware_line
    size = get_size()          # Size(name='cpu', ...)
    size = get_size(ranks=8)   # for a notebook that starts 8 ranks
"""

from __future__ import annotations

import os

from .. import sizes as _sizes
from ..sizes import PRESETS, SIZE_ENV, Size
from .placement import Placement, plan


def _placement(ranks: int | None) -> Placement | None:
    """Where a plain ``launch`` of ``ranks`` ranks would run; ``None`` (no probing) when
    ``$COURSE_SIZE`` decides anyway."""
    if os.environ.get(SIZE_ENV):
        return None
    return plan(ranks or PRESETS["gpu"].world_size)


def size_choice(ranks: int | None = None) -> tuple[str, str]:
    """``(size name, why)``: the size :func:`get_size` picks for a notebook of ``ranks`` ranks
    (``None``: as many as the ``gpu`` preset starts)."""
    return _sizes.size_choice(ranks, _placement(ranks))


def default_size_name(ranks: int | None = None) -> str:
    """``$COURSE_SIZE`` if set; else ``gpu`` when ``ranks`` ranks of a plain ``launch`` would run
    on GPUs, ``cpu`` when they would run on the CPU. ``ranks`` defaults to the ``gpu`` preset's
    ``world_size``; a single-process notebook passes 1."""
    return size_choice(ranks)[0]


def get_size(name: str | None = None, *, ranks: int | None = None) -> Size:
    """The preset called ``name`` (default: :func:`default_size_name` for ``ranks`` ranks)."""
    return _sizes.get_size(name or default_size_name(ranks))


def hardware_line(ranks: int, size: Size | None = None, chosen_for: int | None = None) -> str:
    """The notebooks' hardware line: where ``ranks`` ranks run and why, then the size and why.

    ``chosen_for``: the ``ranks`` the notebook passed to :func:`get_size` (``None``: the default).
    """
    choice = size_choice(chosen_for)
    size = size or _sizes.get_size(choice[0])
    return f"{plan(ranks).describe()}. {_sizes.size_line(size, choice)}."


__all__ = [
    "PRESETS",
    "SIZE_ENV",
    "Size",
    "default_size_name",
    "get_size",
    "hardware_line",
    "size_choice",
]
