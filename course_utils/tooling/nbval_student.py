"""A pytest plugin for nbval: the student copy checked in the same run as the notebook itself.

The repository's ``conftest.py`` loads it, so ``make test`` (``pytest tests notebooks --nbval-lax``)
has it; elsewhere ``pytest -p course_utils.tooling.nbval_student --nbval-lax NOTEBOOK``.

Each notebook runs once, top to bottom, as its source (the model answers in place). At each coding
exercise cell, once the answer has passed, the student copy's version of the cell runs in the same
kernel (``course_utils.tooling.exercises.copy``: the solution replaced by ``raise NotImplementedError``). It
must fail with that error, naming its exercise. Then every name the answer bound and the student
version did not is put back as it was before the answer ran, and every name the student version
rebound (its stub functions) stays. From there on the kernel holds what a student's kernel holds,
so a later cell that uses what an exercise defines fails here, as it would in the student copy.
What this cannot undo is an object the answer changed in place; the notebooks' rule is that
exercises define functions and call their checks, nothing more (``course_utils/tooling/exercises.py``).

``tests/test_student_copies.py`` checks this plugin on notebooks written to fail it, and runs one
whole student copy as a student would. ``COURSE_NBVAL_STUDENT=0`` turns it off.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

_STUDENT_CELLS: dict[str, dict[int, tuple[str, str]]] = {}

_SNAPSHOT = "__nbx_before = dict(globals())"
_AFTER_ANSWER = "__nbx_answer = dict(globals())"
# Names the answer changed, not rebound by the student version: back to their values before it.
_RESTORE = """
__nbx_missing = object()
for __nbx_k, __nbx_v in list(__nbx_answer.items()):
    if __nbx_k.startswith("__nbx") or __nbx_before.get(__nbx_k, __nbx_missing) is __nbx_v:
        continue
    if globals().get(__nbx_k, __nbx_missing) is not __nbx_v:
        continue
    if __nbx_k in __nbx_before:
        globals()[__nbx_k] = __nbx_before[__nbx_k]
    else:
        del globals()[__nbx_k]
del __nbx_before, __nbx_answer, __nbx_missing, __nbx_k, __nbx_v
"""


def _student_cells(path: Path) -> dict[int, tuple[str, str]]:
    """``{cell index: (student source, "exercise N: title")}`` for the coding exercises of a notebook."""
    key = str(path)
    if key not in _STUDENT_CELLS:
        import nbformat

        from course_utils.tooling.exercises import copy, exercises

        nb = nbformat.read(path, as_version=4)
        student = copy(nb, path.stem, "student")
        _STUDENT_CELLS[key] = {
            e.cell: (student.cells[e.cell].source, f"exercise {e.number}: {e.title}")
            for e in exercises(nb, path.stem)
            if e.kind == "code"
        }
    return _STUDENT_CELLS[key]


def _execute(kernel, code: str, timeout: float) -> str | None:
    """Run ``code`` in nbval's kernel and wait for it; ``"Name: message"`` of its error, or None."""
    msg_id = kernel.execute_cell_input(code, allow_stdin=False)
    while True:
        msg = kernel.get_message(stream="shell", timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            reply = msg["content"]
            break
    kernel.await_idle(msg_id, timeout)  # its outputs read and dropped: nbval reads the next cell's
    if reply["status"] == "ok":
        return None
    return f"{reply.get('ename')}: {reply.get('evalue')}"


def _exercise_of(item):
    """``(student source, name)`` when ``item`` is nbval's cell of a coding exercise, else None."""
    if type(item).__name__ != "IPyNbCell" or os.environ.get("COURSE_NBVAL_STUDENT") == "0":
        return None
    nb = getattr(item.parent, "nb", None)
    index = next((i for i, c in enumerate(nb.cells) if c is item.cell), None) if nb else None
    if index is None:
        return None
    return _student_cells(Path(str(item.parent.fspath))).get(index)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    exercise = _exercise_of(item)
    if exercise is None:
        return (yield)
    source, name = exercise
    kernel, timeout = item.parent.kernel, item.config.option.nbval_cell_timeout
    if _execute(kernel, _SNAPSHOT, timeout) is not None:
        raise RuntimeError("could not snapshot the kernel's names before the exercise")
    result = yield  # the source's cell, with the model answer: nbval's own test
    _execute(kernel, _AFTER_ANSWER, timeout)
    error = _execute(kernel, source, timeout)
    restore_error = _execute(kernel, _RESTORE, timeout)
    assert restore_error is None, restore_error
    assert error is not None, f"the student copy of this cell ran without error; {name} must fail"
    other = re.search(r"exercise (\d\d[a-z]?\.\d+)", error or "")
    assert not (error.startswith("NotImplementedError") and other and name not in error), (
        f"the student copy of this cell stopped at exercise {other.group(1) if other else '?'}'s "
        f"stub, before {name!r}: it uses another exercise's answer, so a student who has not "
        f"done that one cannot do this one ({error!r})"
    )
    assert error.startswith("NotImplementedError") and name in error, (
        f"the student copy of this cell failed with {error!r}, not with NotImplementedError "
        f"naming {name!r}"
    )
    return result
