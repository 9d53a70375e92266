"""Student and answer copies: solutions out (or in), everything else identical."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from course_utils.tooling.course import find_notebooks
from course_utils.tooling.exercises import BEGIN, END, MarkupError, copy, exercises, write_copies

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = find_notebooks(ROOT / "notebooks")

EXERCISE = f'''# Exercise 09.1: the sum of squares
def sum_squares(xs):
    """Return the sum of the squares of xs."""
    {BEGIN}
    total = 0
    for x in xs:
        total += x * x
    return total
    {END}


check(sum_squares)'''

ANSWER = f"""**Exercise 09.2 (open).** Why square?

{BEGIN}
Because the model answer says so.
{END}"""


def toy_notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 09 · toy"),
        nbformat.v4.new_code_cell("import math"),
        nbformat.v4.new_code_cell(EXERCISE),
        nbformat.v4.new_markdown_cell(ANSWER),
    ]
    return nb


def test_student_copy_replaces_solutions_and_nothing_else():
    nb = toy_notebook()
    student = copy(nb, "09_toy", "student")
    code = student.cells[2].source
    assert 'raise NotImplementedError("exercise 09.1: the sum of squares")' in code
    assert "    raise NotImplementedError" in code  # at the region's indentation
    assert "total" not in code and BEGIN not in code and END not in code
    assert code.startswith("# Exercise 09.1") and code.endswith("check(sum_squares)")
    assert '"""Return the sum of the squares of xs."""' in code
    assert "model answer" not in student.cells[3].source
    assert "*Your answer here.*" in student.cells[3].source
    assert [c.source for c in student.cells[:2]] == [c.source for c in nb.cells[:2]]
    assert nb.cells[2].source == EXERCISE  # the source notebook is untouched
    namespace = {"check": lambda fn: fn([1, 2])}
    with pytest.raises(NotImplementedError, match="exercise 09.1: the sum of squares"):
        exec(compile(code, "<student>", "exec"), namespace)


def test_answer_copy_keeps_solutions_without_markers():
    answers = copy(toy_notebook(), "09_toy", "answers")
    code = answers.cells[2].source
    assert "total += x * x" in code and BEGIN not in code and END not in code
    assert "model answer says so" in answers.cells[3].source
    namespace = {"check": lambda fn: fn([1, 2])}
    exec(compile(code, "<answers>", "exec"), namespace)
    assert namespace["sum_squares"]([3]) == 9


def test_exercises_are_listed():
    found = exercises(toy_notebook(), "09_toy")
    assert [(e.number, e.kind) for e in found] == [("09.1", "code"), ("09.2", "open")]
    assert found[0].title == "the sum of squares"


def test_an_open_answer_goes_to_the_title_just_above_it_whatever_its_parenthesis():
    nb = toy_notebook()
    title = "**Exercise 09.3 (by hand first).** Count the bytes."
    nb.cells.append(nbformat.v4.new_markdown_cell(title))
    nb.cells.append(nbformat.v4.new_markdown_cell(f"{BEGIN}\nThree.\n{END}"))
    found = exercises(nb, "09_toy")
    assert [(e.number, e.kind) for e in found][-1] == ("09.3", "open")
    assert found[-1].title == "Count the bytes."


@pytest.mark.parametrize(
    "source, words",
    [
        (f"# Exercise 09.1: x\n{BEGIN}\npass", "never closed"),
        (f"# Exercise 09.1: x\n{END}", "without a"),
        (f"# Exercise 09.1: x\n{BEGIN}\n{BEGIN}\n{END}", "inside another region"),
        (f"def f():\n    {BEGIN}\n    pass\n    {END}", "needs a '# Exercise 09.N: title' line"),
        (f"# Exercise 03.1: x\n{BEGIN}\npass\n{END}", "exercise 03.1 in notebook 09"),
    ],
)
def test_bad_markup_is_named(source, words):
    nb = toy_notebook()
    nb.cells[2].source = source
    with pytest.raises(MarkupError, match=words):
        copy(nb, "09_toy", "student")


def solution_lines(nb) -> list[str]:
    """The text lines inside solution regions, short ones included (``n = len(costs)``); only
    blank lines and lines of pure punctuation (a closing ``)`` or ``]``) are left out."""
    lines, inside = [], False
    for cell in nb.cells:
        for line in cell.source.splitlines():
            if line.strip() == BEGIN:
                inside = True
            elif line.strip() == END:
                inside = False
            elif inside and re.search(r"\w", line):
                lines.append(line.strip())
    return lines


def test_solution_lines_count_short_lines():
    nb = toy_notebook()
    nb.cells[2].source = f"# Exercise 09.1: x\n{BEGIN}\nn = 1\nf(\n    n,\n)\n]\n\n{END}"
    assert solution_lines(nb) == ["n = 1", "f(", "n,", "Because the model answer says so."]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_has_two_coding_exercises_and_no_solution_survives(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    found = exercises(nb, path.stem)
    assert sum(e.kind == "code" for e in found) >= 2, f"{path.name}: {found}"
    (student_path,) = [p for p in write_copies("student", tmp_path / "s") if p.name == path.name]
    (answers_path,) = [p for p in write_copies("answers", tmp_path / "a") if p.name == path.name]
    student = nbformat.read(student_path, as_version=4)
    answers = nbformat.read(answers_path, as_version=4)
    assert len(student.cells) == len(answers.cells) == len(nb.cells)
    text = "\n".join(c.source for c in student.cells)
    answer_text = "\n".join(c.source for c in answers.cells)
    source = "\n".join(c.source for c in nb.cells)
    # what lies outside the regions in the source may appear in the copy; nothing else may
    outside = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), "", source, flags=re.S)
    for line in solution_lines(nb):
        assert line not in text or line in outside, f"{path.name}: {line!r} survives"
        assert line in answer_text, f"{path.name}: {line!r} is missing from the answers copy"
    for marker in (BEGIN, END):
        assert marker not in text and marker not in answer_text


@pytest.mark.parametrize("kind", ["student", "answers"])
def test_copies_carry_no_outputs_even_when_the_source_has_them(kind):
    """A source notebook executed by mistake (make course writes outputs into build/, but an
    instructor may save one in place): its copies still start clean."""
    nb = toy_notebook()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.execution_count = 7
            cell.outputs = [nbformat.v4.new_output("stream", text="the answer is 55\n")]
    out = copy(nb, "09_toy", kind)
    code = [c for c in out.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert all(c.execution_count == 7 for c in nb.cells if c.cell_type == "code")  # source intact
