"""What the exercise-check tests (tests/test_checks_nb*.py) share: a right answer passes; a wrong
one must get its hint, never the answer."""

from __future__ import annotations

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
