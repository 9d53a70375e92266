"""Shared fixtures: a private runs root per test and helpers to check for leftover processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture
def runs_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("COURSE_RUNS_DIR", str(root))
    return root


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids, within: float = 5.0) -> list[int]:
    """Return the pids still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.05)
    return alive


def only_run_dir(root: Path) -> Path:
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(runs) == 1, runs
    return runs[0]


def rank_pids(run_dir: Path) -> list[int]:
    return list(json.loads((run_dir / "launch.json").read_text())["pids"].values())


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"
)
