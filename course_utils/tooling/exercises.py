"""Exercises in the notebooks: solutions marked in the sources, student copies without them.

A coding exercise is one code cell. It starts with a title line, and the lines a student must
write sit between nbgrader's markers, which many Jupyter users already know::

    # Exercise 03.2: all-reduce from reduce-scatter and all-gather
    def ring_all_reduce(t):
        ### BEGIN SOLUTION
        ...model answer...
        ### END SOLUTION

    checks.ring_all_reduce(ring_all_reduce)    # the check: computes the expected result itself

A model answer to an open question sits between the same two lines in a markdown cell.

- ``student`` copies (``make student`` -> ``build/student/``): each solution region in code becomes
  ``raise NotImplementedError("exercise 03.2: all-reduce from ...")`` at the region's indentation,
  each model answer becomes *Your answer here.*; everything else is identical.
- ``answers`` copies (``make answers`` -> ``build/answers/``): the marker lines removed, the
  solutions kept. The sources in ``notebooks/`` are those too, with the markers.

Each exercise cell calls its check at the end, and nothing later in the notebook uses what the
exercise defines: a student copy therefore fails at its exercise cells, and nowhere else.

    python -m course_utils copies --kind student --out build/student
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .course import NOTEBOOK_DIR, find_notebooks

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
TITLE = re.compile(r"^#\s*Exercise\s+(\d\d[a-z]?\.\d+)\s*:\s*(.+?)\s*$")
ANSWER_HERE = "*Your answer here.*"


class MarkupError(ValueError):
    """A notebook whose solution markers cannot be read, with the notebook and cell named."""


@dataclass(frozen=True)
class Exercise:
    notebook: str
    cell: int
    number: str
    """``"03.2"``: the notebook's number, then the exercise's."""
    title: str
    kind: str
    """``"code"`` (a function to write, with a check) or ``"open"`` (a model answer in markdown)."""


def _regions(lines: list[str], where: str) -> list[tuple[int, int]]:
    """``(begin, end)`` line indices of every solution region; raise on unbalanced markers."""
    regions, start = [], None
    for i, line in enumerate(lines):
        mark = line.strip()
        if mark == BEGIN:
            if start is not None:
                raise MarkupError(f"{where}: '{BEGIN}' at line {i + 1} inside another region")
            start = i
        elif mark == END:
            if start is None:
                raise MarkupError(f"{where}: '{END}' at line {i + 1} without a '{BEGIN}'")
            regions.append((start, i))
            start = None
    if start is not None:
        raise MarkupError(f"{where}: '{BEGIN}' at line {start + 1} is never closed")
    return regions


def _title(lines: list[str], where: str, prefix: str) -> tuple[str, str]:
    for line in lines:
        m = TITLE.match(line.strip())
        if m:
            if m.group(1).split(".")[0] != prefix:
                raise MarkupError(f"{where}: exercise {m.group(1)} in notebook {prefix}")
            return m.group(1), m.group(2)
    raise MarkupError(
        f"{where}: a solution region needs a '# Exercise {prefix}.N: title' line in its cell "
        "(the student copy's NotImplementedError names it)"
    )


def _prefix(name: str) -> str:
    """``03`` for ``03_ddp``, ``03b`` for ``03b_ddp_in_practice``: the exercises' number prefix."""
    m = re.match(r"^(\d\d[a-z]?)_", name)
    return m.group(1) if m else name[:2]


def exercises(nb, name: str) -> list[Exercise]:
    """The exercises of notebook ``nb`` (called ``name``, e.g. ``03_ddp``), in order."""
    prefix, found, last_title = _prefix(name), [], None
    for i, cell in enumerate(nb.cells):
        lines = cell.source.splitlines()
        regions = _regions(lines, f"{name} cell {i}")
        if cell.cell_type == "markdown":
            for line in lines:
                m = re.search(
                    r"Exercise\s+(\d\d[a-z]?\.\d+)\s*(?:\([^)]*\))?\s*[:.]\s*(.*?)\*{0,2}\s*$", line
                )
                if m:
                    last_title = (m.group(1), m.group(2).strip(" *") or "open question")
            if regions:
                if last_title is None:
                    raise MarkupError(f"{name} cell {i}: a model answer before any exercise title")
                found.append(Exercise(name, i, last_title[0], last_title[1], "open"))
        elif regions:
            number, title = _title(lines, f"{name} cell {i}", prefix)
            found.append(Exercise(name, i, number, title, "code"))
    numbers = [e.number for e in found if e.kind == "code"]
    if len(numbers) != len(set(numbers)):
        raise MarkupError(f"{name}: an exercise number is used twice: {numbers}")
    return found


def _student_cell(cell, where: str, prefix: str) -> None:
    lines = cell.source.splitlines()
    regions = _regions(lines, where)
    if not regions:
        return
    if cell.cell_type == "code":
        number, title = _title(lines, where, prefix)
        message = f"exercise {number}: {title}".replace("\\", "\\\\").replace('"', '\\"')
    out, pos = [], 0
    for start, end in regions:
        out += lines[pos:start]
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        if cell.cell_type == "code":
            out.append(f'{indent}raise NotImplementedError("{message}")')
        else:
            out.append(f"{indent}{ANSWER_HERE}")
        pos = end + 1
    out += lines[pos:]
    cell.source = "\n".join(out)


def _answer_cell(cell, where: str) -> None:
    lines = cell.source.splitlines()
    if _regions(lines, where):
        cell.source = "\n".join(ln for ln in lines if ln.strip() not in (BEGIN, END))


def copy(nb, name: str, kind: str):
    """A ``"student"`` or ``"answers"`` copy of notebook ``nb`` (a new object; outputs cleared)."""
    import copy as _copy

    if kind not in ("student", "answers"):
        raise ValueError(f"kind must be 'student' or 'answers', got {kind!r}")
    exercises(nb, name)  # validates the markup first
    out = _copy.deepcopy(nb)
    for i, cell in enumerate(out.cells):
        where = f"{name} cell {i}"
        if kind == "student":
            _student_cell(cell, where, _prefix(name))
        else:
            _answer_cell(cell, where)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return out


def write_copies(kind: str, out: str | Path, src: str | Path | None = None) -> list[Path]:
    """Write a ``kind`` copy of every numbered notebook in ``src`` into ``out``; return the paths."""
    import nbformat

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in find_notebooks(Path(src) if src else NOTEBOOK_DIR):
        nb = nbformat.read(path, as_version=4)
        target = out / path.name
        nbformat.write(copy(nb, path.stem, kind), target)
        written.append(target)
    return written


__all__ = ["BEGIN", "END", "Exercise", "MarkupError", "copy", "exercises", "write_copies"]
