"""Exceptions :func:`course_utils.launch` raises, each saying what to do next."""

from __future__ import annotations

from pathlib import Path

RED, RESET = "\x1b[0;31m", "\x1b[0m"


def _rendered(name: str, message: str) -> list[str]:
    """What IPython shows for the launcher's exceptions: the name and the message, no frames."""
    return [f"{RED}{name}{RESET}: {message}"]


class LaunchError(RuntimeError):
    """A launched job did not finish cleanly.

    ``results`` holds the return values of the ranks that did finish (rank ->
    value); they are also on disk in ``run_dir`` (``load_results(run_dir)``).

    In Jupyter the error shows as its message alone (``_render_traceback_``): the message already
    holds the failing rank's own traceback, and the launcher's frames would only hide it.
    """

    def __init__(self, message: str, run_dir: Path | None = None, results: dict | None = None):
        super().__init__(message)
        self.run_dir = run_dir
        self.results = dict(results or {})

    def _render_traceback_(self) -> list[str]:
        return _rendered(type(self).__name__, str(self))


class LaunchInterrupted(KeyboardInterrupt):
    """Jupyter's interrupt (or Ctrl-C) reached a launch; every rank was stopped.

    It is a ``KeyboardInterrupt``, so the notebook stops as it would anywhere, but it shows as one
    line instead of a traceback through the launcher and the standard library.
    """

    def _render_traceback_(self) -> list[str]:
        return _rendered("KeyboardInterrupt", str(self))


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
