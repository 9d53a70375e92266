"""What the exercise-check tests (tests/test_checks_nb*.py) share: a right answer passes; a wrong
one must get its hint, never the answer."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from course_utils.checks import ExerciseError


def fails(check, answer, hint: str, absent=()) -> str:
    """Run ``check(answer)``: it must raise ExerciseError naming ``hint`` and none of ``absent``."""
    with pytest.raises(ExerciseError) as info:
        check(answer)
    message = str(info.value)
    assert hint in message, message
    for value in absent:
        assert str(value) not in message, f"{value!r} (the expected answer) in: {message}"
    return message


def pasted(fn, name, docstring: bool = True):
    """``fn``'s source pasted under another name, as a student might copy it from the package
    (``docstring=False``: without its docstring)."""
    src = textwrap.dedent(inspect.getsource(fn)).replace(f"def {fn.__name__}(", f"def {name}(")
    if not docstring and fn.__doc__:
        tree = ast.parse(src)
        tree.body[0].body = tree.body[0].body[1:]  # the docstring is the first statement
        src = ast.unparse(tree)
    ns = dict(vars(inspect.getmodule(fn)))
    exec(compile(src, "<cell>", "exec"), ns)
    return ns[name]
