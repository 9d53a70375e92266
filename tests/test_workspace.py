"""Working copies: created once, refreshed after a course update, a student's edits never lost."""

from __future__ import annotations

import subprocess
from pathlib import Path

import nbformat

from course_utils.tooling.exercises import BEGIN, END
from course_utils.tooling.workspace import MANIFEST, prepare, report

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


def edit(path: Path, cell: int, source: str | None = None, output: str | None = None) -> None:
    nb = nbformat.read(path, as_version=4)
    if source is not None:
        nb.cells[cell].source = source
    if output is not None:
        nb.cells[cell].outputs = [nbformat.v4.new_output("stream", text=output)]
    nbformat.write(nb, path)


def test_an_updated_copy_the_student_moved_to_is_never_overwritten(tmp_path):
    """``make lab`` runs prepare every time: the ``.updated`` copy must survive later runs."""
    src, work = tmp_path / "notebooks", tmp_path / "work"
    src.mkdir()
    write_source(src, "01_a", "version 1")
    prepare(work, src=src)
    edit(work / "01_a.ipynb", 1, source="def f(a, b):\n    return b + a  # my answer")
    write_source(src, "01_a", "version 2")
    updated = work / "01_a.updated.ipynb"
    (change,) = prepare(work, src=src)  # the course update: the new version goes beside it
    assert (change.action, change.path) == ("kept", updated)

    # the student runs the new version: outputs only, so the next make lab may not rewrite it
    edit(updated, 1, output="ran")
    (change,) = prepare(work, src=src)
    assert (change.action, change.path) == ("kept", updated)
    assert nbformat.read(updated, as_version=4).cells[1].outputs, "outputs of .updated lost"

    # ... then moves to it, as the message suggests, and writes code there
    edit(updated, 1, source="def f(a, b):\n    return a + b  # my answer, moved")
    (change,) = prepare(work, src=src)
    assert (change.action, change.path) == ("edited", updated)
    assert "moved" in nbformat.read(updated, as_version=4).cells[1].source
    assert "both kept" in report([change])

    # the course changes again: neither edited copy is touched, the new version gets a fresh name
    write_source(src, "01_a", "version 3")
    (change,) = prepare(work, src=src)
    second = work / "01_a.updated-2.ipynb"
    assert (change.action, change.path, change.also_kept) == ("kept", second, [updated])
    assert "moved" in nbformat.read(updated, as_version=4).cells[1].source
    assert "my answer" in nbformat.read(work / "01_a.ipynb", as_version=4).cells[1].source
    assert nbformat.read(second, as_version=4).cells[0].source == "version 3"
    assert "01_a.updated.ipynb: you edited it too" in report([change])
    assert [c.action for c in prepare(work, src=src)] == ["kept"]  # and stays put after that
    assert sorted(p.name for p in work.glob("*.ipynb")) == [
        "01_a.ipynb",
        "01_a.updated-2.ipynb",
        "01_a.updated.ipynb",
    ]


def test_an_untouched_updated_copy_is_refreshed_to_the_newest_version(tmp_path):
    """A student who edited 01 and never opened 01_a.updated.ipynb must find the *newest* course
    version there after the next update, in place, not a second copy beside a stale one."""
    src, work = tmp_path / "notebooks", tmp_path / "work"
    src.mkdir()
    write_source(src, "01_a", "version 1")
    prepare(work, src=src)
    edit(work / "01_a.ipynb", 1, source="def f(a, b):\n    return b + a  # my answer")
    write_source(src, "01_a", "version 2")
    updated = work / "01_a.updated.ipynb"
    assert prepare(work, src=src)[0].path == updated
    assert nbformat.read(updated, as_version=4).cells[0].source == "version 2"
    write_source(src, "01_a", "version 3")  # .updated untouched: refreshed in place
    (change,) = prepare(work, src=src)
    assert (change.action, change.path, change.also_kept) == ("kept", updated, [])
    assert nbformat.read(updated, as_version=4).cells[0].source == "version 3"
    assert not (work / "01_a.updated-2.ipynb").exists()
    assert "my answer" in nbformat.read(work / "01_a.ipynb", as_version=4).cells[1].source


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
