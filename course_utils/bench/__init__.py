"""Benchmarks behind ``python -m course_utils bench ...``; results go to benchmarks/RESULTS.md."""

import os
import platform
import time

from ..launcher import launch


def provenance() -> dict:
    """Where and when a benchmark ran, as RESULTS.md records it: ``{"machine": ..., "date": ...}``."""
    return {
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "date": time.strftime("%Y-%m-%d"),
    }


def alternating(worker, runs, rounds: int, **launch_kw) -> tuple[dict, dict, str | None]:
    """Launch ``worker`` for every ``(name, world_size)`` in ``runs``, ``rounds`` times.

    Odd rounds go in reverse order, so a slow spell of a shared machine does not fall on
    the same run every time. Returns ``(samples_ms, results, backend)``: each run's slowest
    rank's ``step_s`` per round in milliseconds, its last round's per-rank results, and the
    backend of the multi-rank runs. ``launch_kw`` go to every launch; ``name`` is passed to
    the worker as ``name_kw``.
    """

    name_kw = launch_kw.pop("name_kw")
    samples = {key: [] for key in runs}
    results, backend = {}, None
    for i in range(rounds):
        for name, n in runs if i % 2 == 0 else runs[::-1]:
            res = launch(worker, n, echo=False, progress=False, **{name_kw: name}, **launch_kw)
            samples[name, n].append(max(r["step_s"] for r in res.results) * 1e3)
            results[name, n] = res.results
            backend = res.backend if n > 1 else backend
    return samples, results, backend
