"""Working copies: created once, refreshed after a course update, a student's edits never lost."""

from __future__ import annotations

import subprocess
from pathlib import Path

import nbformat

from course_utils.exercises import BEGIN, END
from course_utils.workspace import MANIFEST, prepare

ROOT = Path(__file__).resolve().parents[1]


def write_source(folder: Path, name: str, text: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(text),
        nbformat.v4.new_code_cell(
            f"# Exercise {name[:2]}.1: add\ndef f(a, b):\n    {BEGIN}\n    return a + b\n    {END}"
        ),
    ]
    nbformat.write(nb, folder / f"{name}.ipynb")


def actions(changes) -> dict[str, str]:
    return {c.name: c.action for c in changes}


def test_working_copies_survive_a_course_update(tmp_path):
    src, work = tmp_path / "notebooks", tmp_path / "work"
    src.mkdir()
    write_source(src, "01_a", "version 1")
    write_source(src, "02_b", "version 1")
    assert actions(prepare(work, src=src)) == {"01_a.ipynb": "created", "02_b.ipynb": "created"}
    student = nbformat.read(work / "01_a.ipynb", as_version=4)
    assert (
        "NotImplementedError" in student.cells[1].source
        and "return a + b" not in student.cells[1].source
    )

    # the student runs 01 (outputs only) and writes code in 02
    student.cells[1].outputs = [nbformat.v4.new_output("stream", text="ran")]
    nbformat.write(student, work / "01_a.ipynb")
    edited = nbformat.read(work / "02_b.ipynb", as_version=4)
    edited.cells[1].source = "def f(a, b):\n    return b + a  # my answer"
    nbformat.write(edited, work / "02_b.ipynb")
    assert actions(prepare(work, src=src)) == {"01_a.ipynb": "unchanged", "02_b.ipynb": "unchanged"}

    # the course changes both notebooks; git pull, then make update
    write_source(src, "01_a", "version 2")
    write_source(src, "02_b", "version 2")
    changes = actions(prepare(work, src=src))
    assert changes == {"01_a.ipynb": "updated", "02_b.ipynb": "kept"}
    assert nbformat.read(work / "01_a.ipynb", as_version=4).cells[0].source == "version 2"
    mine = nbformat.read(work / "02_b.ipynb", as_version=4)
    assert "my answer" in mine.cells[1].source  # never overwritten
    beside = nbformat.read(work / "02_b.updated.ipynb", as_version=4)
    assert beside.cells[0].source == "version 2"
    assert (work / MANIFEST).exists()


def test_work_is_ignored_by_git_and_sources_stay_clean(tmp_path):
    out = subprocess.run(
        ["git", "check-ignore", "work/01_single_gpu.ipynb"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, "work/ must be ignored by git"
    makefile = (ROOT / "Makefile").read_text()
    lab = makefile.split("\nlab:")[1].split("\n\n")[0]
    assert "jupyter lab work/" in lab and "notebooks/" not in lab
