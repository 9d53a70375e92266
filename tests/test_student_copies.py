"""Executed, a student copy fails at its exercise cells, with the exercise's message, and nowhere else."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from course_utils.course import find_notebooks
from course_utils.exercises import copy, exercises

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

NOTEBOOKS = find_notebooks(Path(__file__).resolve().parents[1] / "notebooks")


def error_text(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            return f"{out.ename}: {out.evalue}"
    return None


@pytest.mark.timeout(900)  # a whole notebook (03: about 100 s at ci) plus checks that launch ranks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_student_copy_fails_only_at_its_exercises(path, monkeypatch):
    monkeypatch.setenv("COURSE_SIZE", "ci")
    source = nbformat.read(path, as_version=4)
    coding = {e.cell: e for e in exercises(source, path.stem) if e.kind == "code"}
    student = copy(source, path.stem, "student")
    NotebookClient(
        student,
        timeout=900,
        kernel_name=source.metadata["kernelspec"]["name"],
        allow_errors=True,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    failed = {i: error_text(c) for i, c in enumerate(student.cells) if error_text(c)}
    assert sorted(failed) == sorted(coding), {i: failed.get(i) for i in set(failed) | set(coding)}
    for i, e in coding.items():
        assert failed[i].startswith("NotImplementedError"), failed[i]
        assert f"exercise {e.number}: {e.title}" in failed[i], failed[i]
