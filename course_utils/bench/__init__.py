"""Benchmarks behind ``python -m course_utils bench ...``; results go to benchmarks/RESULTS.md."""

import os
import platform
import time


def provenance() -> dict:
    """Where and when a benchmark ran, as RESULTS.md records it: ``{"machine": ..., "date": ...}``."""
    return {
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "date": time.strftime("%Y-%m-%d"),
    }
