"""Per-rank profiler traces: capture (``launch(profile=...)``), parse, analyse, plot.

Layers, each usable alone (HolisticTraceAnalysis-style):

- capture: ``ProfileConfig`` and the per-rank profiler session live in the launcher
  (:mod:`course_utils.launcher.profiler`), which runs them; re-exported here;
- :mod:`.trace`: read Kineto/Chrome traces (plain or .gz) into compact columns;
- :mod:`.analysis`: classify time per rank and step, overlap, stragglers;
- :mod:`.plots`: timelines and breakdown bars drawn from the analysis;
- :mod:`.collectives`: the collective benchmark (algorithm and bus bandwidth).

Taught in notebook 04.
"""

from ..launcher.profiler import ProfileConfig

__all__ = ["ProfileConfig"]
