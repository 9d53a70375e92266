"""The notebooks on a busy node: every one passes at the ci size while two busy loops hold the cores.

An instructor runs the notebooks on a shared JupyterHub node where other people's work competes for
the CPU; assertions that rest on timing must still hold there. Run it several times in a row with
``pytest tests/test_notebooks_contended.py --count`` style loops (see the README's instructor guide).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from course_utils.tooling.course import find_notebooks

# Not in `make test`: on CI's shared 2 cores a contended notebook can run for many minutes.
# `make test-contended` runs it; its own limit is above NotebookClient's, so that the client times
# out first and shuts its kernel down.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.notebook,
    pytest.mark.contended,
    pytest.mark.timeout(1800),
]

NOTEBOOKS = find_notebooks(Path(__file__).resolve().parents[1] / "notebooks")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_passes_with_the_cores_contended(path, busy_cores, monkeypatch):
    assert all(p.poll() is None for p in busy_cores), "the busy loops died"
    monkeypatch.setenv("COURSE_SIZE", "ci")
    nb = nbformat.read(path, as_version=4)
    kernel = nb.metadata.get("kernelspec", {}).get("name", "python3")
    NotebookClient(
        nb, timeout=900, kernel_name=kernel, resources={"metadata": {"path": str(path.parent)}}
    ).execute()  # raises CellExecutionError, naming the cell, when an assertion fails
    assert os.environ["COURSE_SIZE"] == "ci"
