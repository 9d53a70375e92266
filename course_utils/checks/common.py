"""What every exercise check shares: the error, the success line, running the student's code."""

from __future__ import annotations


class ExerciseError(AssertionError):
    """The student's answer is not right yet; the message says where, and gives a hint."""


def passed(number: str, what: str) -> None:
    """The one line a passing check prints."""
    print(f"✓ exercise {number}: {what}")


def fail(number: str, message: str) -> None:
    raise ExerciseError(f"exercise {number}: {message}")


def launch_check(number: str, worker, world_size: int, **kwargs):
    """Launch ``worker`` (which calls the student's code in every rank) and unwrap its errors.

    A student copy's ``NotImplementedError`` and a check's :class:`ExerciseError` raised inside a
    rank come back as themselves, with the rank named, instead of as a launcher error.
    """
    from ..launcher import RankFailedError, launch

    try:
        return launch(worker, world_size, echo=False, **kwargs)
    except RankFailedError as e:
        if e.exc_type == "NotImplementedError":
            raise NotImplementedError(e.exc_message) from None
        if e.exc_type == "ExerciseError":
            raise ExerciseError(f"rank {e.rank}: {e.exc_message}") from None
        raise
