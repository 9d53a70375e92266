"""Tooling from day one: the tree is ruff-clean (lint and format), notebooks included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_check():
    out = ruff("check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr + "\nRun `make format`."


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        dirty = [
            i
            for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and (c.outputs or c.execution_count)
        ]
        assert not dirty, (
            f"{nb_path.name}: cells {dirty} carry outputs; clear them before committing"
        )
