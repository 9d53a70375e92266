"""Student copies fail at their exercise cells, with the exercise's message, and nowhere else.

``make test`` checks every notebook's student copy inside its nbval run (the plugin
``course_utils.tooling.nbval_student``, loaded by the repository's conftest.py). Here: the plugin against
small notebooks written to break each rule, and one whole student copy executed as a student
would, against what the plugin concluded for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from course_utils.tooling.exercises import copy, exercises

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
KERNEL = nbformat.read(ROOT / "notebooks" / "02_data_parallel.ipynb", 4).metadata["kernelspec"]

CHECK = "def check(f):\n    assert f(3) == 6, 'double(3) must be 6'\n    print('ok')"
EXERCISE = """# Exercise 90.1: double a number
def double(x):
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION


check(double)"""
EXERCISE_2 = """# Exercise 90.2: six times
def six_times(x):
    ### BEGIN SOLUTION
    return 6 * x
    ### END SOLUTION


try:
    assert six_times(2) == 12
except NotImplementedError:  # a fallback on exercise 90.1's answer: in the student copy, its stub
    print(3 * double(2))"""
CASES = {
    # name: (cells, the nbval cell that must fail or None, what its failure must say)
    "good": ([CHECK, EXERCISE, "print(3 + 3)", "y = 1"], None, None),
    "uses_the_answer": ([CHECK, EXERCISE, "print(double(4))"], 2, "NotImplementedError"),
    "answer_binds_a_name": (
        [
            CHECK,
            EXERCISE.replace("return 2 * x", "return 2 * x\n    global SCALE\n    SCALE = 2")
            + "\nfactor = 2",
            "print(factor)",
        ],
        2,
        "NameError",
    ),
    "student_passes": (
        [CHECK, EXERCISE.replace("check(double)", "print('no check')")],
        1,
        "ran without error",
    ),
    "stops_at_another_exercise": ([CHECK, EXERCISE, EXERCISE_2], 2, "exercise 90.1"),
    "wrong_error": (
        [
            CHECK,
            EXERCISE.replace(
                "check(double)",
                "try:\n    check(double)\nexcept "
                "NotImplementedError:\n    raise ValueError('swallowed')",
            ),
        ],
        1,
        "not with NotImplementedError",
    ),
}


def _notebook(cells: list[str]):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNEL
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    return nb


def test_the_plugin_fails_what_a_student_copy_would(tmp_path):
    for name, (cells, _, _) in CASES.items():
        nbformat.write(_notebook(cells), tmp_path / f"90_{name}.ipynb")
    report = tmp_path / "report.json"
    plugin = tmp_path / "collect.py"
    plugin.write_text(
        "import json\nresults = {}\n"
        "def pytest_runtest_logreport(report):\n"
        "    if report.when == 'call':\n"
        "        results[report.nodeid] = [report.outcome, str(report.longrepr or '')]\n"
        f"def pytest_sessionfinish(session):\n    open({str(report)!r}, 'w').write(json.dumps(results))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "course_utils.tooling.nbval_student", "-p", "collect",
         "--nbval-lax", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )  # fmt: skip
    results = json.loads(report.read_text())
    for name, (cells, failing, says) in CASES.items():
        outcomes = {
            int(k.rsplit("Cell ", 1)[1]): v for k, v in results.items() if f"90_{name}" in k
        }
        assert len(outcomes) == len(cells), (name, outcomes, proc.stdout[-3000:])
        for i, (outcome, text) in outcomes.items():
            if i == failing:
                assert outcome == "failed" and says in text, (name, i, outcome, text[-2000:])
            else:
                assert outcome == "passed", (name, i, outcome, text[-2000:])


def test_the_plugin_stands_aside_for_notebooks_without_exercises(tmp_path):
    nbformat.write(_notebook(["x = 1", "print(x)"]), tmp_path / "90_plain.ipynb")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "course_utils.tooling.nbval_student", "--nbval-lax",
         "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-2000:]


def error_text(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            return f"{out.ename}: {out.evalue}"
    return None


@pytest.mark.timeout(900)
def test_a_whole_student_copy_fails_only_at_its_exercises(monkeypatch):
    """One notebook's student copy, executed as a student would (02: about 10 s at ci)."""
    path = ROOT / "notebooks" / "02_data_parallel.ipynb"
    monkeypatch.setenv("COURSE_SIZE", "ci")
    source = nbformat.read(path, as_version=4)
    coding = {e.cell: e for e in exercises(source, path.stem) if e.kind == "code"}
    assert coding
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
