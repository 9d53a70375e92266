"""Every exercise check on the corpus of solutions written from the student copies alone
(tests/fixtures/solutions, see tests/corpus.py): each correct one passes, each wrong one fails
with a message that names its mistake (its ``expect:`` line)."""

from __future__ import annotations

import os
import re

import pytest

from course_utils.checks import nb02

from .corpus import EXERCISES, ROOT, expected, run, solutions, verdict

pytestmark = [pytest.mark.slow]

# Exercises whose check starts ranks (several seconds a solution): make test runs two correct and
# two wrong solutions of each (the first in name order: CI's time, 2026-11-27); make test-corpus,
# or COURSE_CORPUS=all, runs every one. The other checks run on the whole corpus every time (well
# under a second each).
DISTRIBUTED = {"03.1", "03.2", "03b.1", "03b.2", "05.3", "06.1", "06.3", "07.3", "08.2", "08.3",
               "09.2", "09.3", "10.2", "11.1", "11.2"}  # fmt: skip


def _selected() -> list:
    every = solutions()
    if os.environ.get("COURSE_CORPUS") == "all":
        return every
    out = []
    for exercise in sorted({p.parent.name for p in every}):
        files = [p for p in every if p.parent.name == exercise]
        if exercise in DISTRIBUTED:
            files = [p for p in files if verdict(p) == "correct"][:2] + [
                p for p in files if verdict(p) == "wrong"
            ][:2]
        out += files
    return out


ALL = _selected()

# A wrong 02.x solution whose expected failure is that its replicas never meet at the check's
# barrier (they run in turn) breaks it however long the wait: 0.5 s, not 10 s, changes only when.
IN_TURN = "expect: forward in a thread of its own before waiting for any"


def test_every_exercise_has_three_correct_and_three_wrong_solutions():
    for exercise in EXERCISES:
        files = solutions(exercise) if (ROOT / exercise).is_dir() else []
        correct = [f for f in files if verdict(f) == "correct"]
        wrong = [f for f in files if verdict(f) == "wrong"]
        assert len(correct) >= 3 and len(wrong) >= 3, (exercise, len(correct), len(wrong))
        for f in wrong:
            assert expected(f), f"{f}: a wrong solution says what its failure must name (expect:)"


@pytest.mark.parametrize("path", ALL, ids=[f"{p.parent.name}/{p.stem}" for p in ALL])
def test_the_check_judges_the_solution(path, runs_root, capsys, monkeypatch):
    # judged on the exercise alone: the solutions were written and run on CPUs, and a tensor made
    # without a device (which make test's device check refuses, as a GPU would) is not their point
    monkeypatch.setenv("COURSE_CHECK_DEVICES", "0")
    exercise = path.parent.name
    if verdict(path) == "wrong" and IN_TURN in path.read_text():
        monkeypatch.setattr(nb02, "REPLICA_WAIT_S", 0.5)
    if verdict(path) == "correct":
        run(exercise, path)
        assert f"✓ exercise {exercise}" in capsys.readouterr().out
        return
    with pytest.raises(Exception) as info:
        run(exercise, path)
    message = str(info.value)
    assert re.search(expected(path), message, re.IGNORECASE | re.DOTALL), message
