"""Holistic Trace Analysis (HTA, Meta's ``HolisticTraceAnalysis`` package) on the same traces.

Notebook 04 puts HTA's numbers beside the course's own breakdown: HTA is the tool users meet next
for real GPU jobs. It reads a folder of per-rank Kineto traces and analyses what ran on the **GPU**:
its temporal breakdown splits each rank's time into computation kernels, non-computation (NCCL
kernels, memory copies and fills) and idle, and its overlap metric is the share of communication
kernels' time during which a computation kernel also ran. A CPU-only (gloo) trace has no GPU kernels:
the breakdown has nothing to break down, and :func:`summary` says so instead of returning numbers.

    from course_utils.profiling.hta import summary
    out = summary(res.traces)          # {"temporal": DataFrame, "overlap": DataFrame} or {"why": str}
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
import warnings
from pathlib import Path

from .trace import load_trace


def summary(traces: dict[int, Path]) -> dict:
    """HTA's temporal breakdown and communication/computation overlap of ``traces`` (rank -> path),
    or ``{"why": ...}``: HTA not installed, or traces without GPU kernels."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        return {"why": "HolisticTraceAnalysis is not installed (pip install HolisticTraceAnalysis)"}

    if not any(load_trace(p).has_gpu for p in traces.values()):
        return {
            "why": "these traces hold no GPU kernels (CPU ranks with gloo): HTA analyses GPU "
            "streams, and its temporal breakdown has nothing to split"
        }
    with tempfile.TemporaryDirectory(prefix="hta-") as folder:
        for rank, path in traces.items():
            shutil.copy(path, Path(folder) / f"rank{rank}.{Path(path).name.split('.', 1)[1]}")
        quiet = io.StringIO()
        logging.getLogger("hta").setLevel(logging.WARNING)
        with (
            contextlib.redirect_stdout(quiet),
            contextlib.redirect_stderr(quiet),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")  # HTA's own pandas deprecations, not the student's
            analysis = TraceAnalysis(trace_dir=folder)
            temporal = analysis.get_temporal_breakdown(visualize=False)
            overlap = analysis.get_comm_comp_overlap(visualize=False)
    return {"temporal": temporal, "overlap": overlap}


__all__ = ["summary"]
