"""Exceptions :func:`course_utils.launch` raises, each saying what to do next."""

from __future__ import annotations

from pathlib import Path


class LaunchError(RuntimeError):
    """A launched job did not finish cleanly.

    ``results`` holds the return values of the ranks that did finish (rank ->
    value); they are also on disk in ``run_dir`` (``load_results(run_dir)``).
    """

    def __init__(self, message: str, run_dir: Path | None = None, results: dict | None = None):
        super().__init__(message)
        self.run_dir = run_dir
        self.results = dict(results or {})


class RankFailedError(LaunchError):
    """A rank raised an exception or was killed by a signal.

    ``exc_type`` and ``exc_message``: the name and text of the rank's exception (``None`` when
    it was killed instead).
    """

    def __init__(
        self,
        message: str,
        rank: int,
        run_dir=None,
        results=None,
        signal: int | None = None,
        exc_type: str | None = None,
        exc_message: str | None = None,
    ):
        super().__init__(message, run_dir, results)
        self.rank = rank
        self.signal = signal
        self.exc_type, self.exc_message = exc_type, exc_message


class RankTimeoutError(LaunchError):
    """The job ran past ``timeout``; the message holds every live rank's Python stack."""

    def __init__(self, message: str, stacks: dict[int, str], run_dir=None, results=None):
        super().__init__(message, run_dir, results)
        self.stacks = stacks
