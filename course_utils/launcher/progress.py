"""One compact status per rank while a launch runs: starting, step k of n, done, failed.

Each rank writes its state to ``rank{r}.status`` (:class:`.context.StatusFile`); ``ctx.step()``
reports the steps. The launcher shows them once a run has lasted more than ``delay`` seconds:
as an ipywidgets row in a Jupyter notebook, as one line that rewrites itself in a terminal, and
not at all when the output goes to a file or a pipe. The ``[rank r]`` lines a rank prints appear
as before, below it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .context import read_status

SYMBOLS = {"done": "✓", "failed": "✗", "stopped": "■"}


def _in_jupyter() -> bool:
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return False
    if shell is None or not hasattr(shell, "kernel"):
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def describe(status: tuple[str, int, int | None] | None) -> str:
    """``"step 3/10"``, ``"starting"``, ``"done ✓"``: one rank's state in a few characters."""
    if status is None:
        return "starting"
    state, step, total = status
    if state == "step":
        return f"step {step}/{total}" if total else f"step {step}"
    if state in SYMBOLS:
        return f"{state} {SYMBOLS[state]}"
    return state


class Progress:
    """The display for one launch; :meth:`update` is called from the supervision loop."""

    def __init__(self, run_dir: Path, world_size: int, delay: float = 3.0, mode: str | None = None):
        self.run_dir, self.world_size, self.delay = Path(run_dir), world_size, delay
        self.t0 = time.monotonic()
        self.last = 0.0
        if mode is None:
            mode = "widget" if _in_jupyter() else "line" if sys.stdout.isatty() else "off"
        self.mode = mode
        self.widget = None
        self.final: dict[int, str] = {}

    def states(self) -> list[str]:
        out = []
        for r in range(self.world_size):
            if r in self.final:
                out.append(self.final[r])
            else:
                out.append(describe(read_status(self.run_dir / f"rank{r}.status")))
        return out

    def text(self) -> str:
        elapsed = time.monotonic() - self.t0
        ranks = "  ".join(f"rank {r}: {s}" for r, s in enumerate(self.states()))
        return f"{ranks}   ({elapsed:.0f} s)"

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.mode == "off" or (now - self.t0 < self.delay and not force):
            return
        if not force and now - self.last < 0.5:
            return
        self.last = now
        if self.mode == "widget":
            self._widget()
        else:
            sys.stdout.write("\r" + self.text() + "\x1b[K")
            sys.stdout.flush()

    def _widget(self) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        states = self.states()
        if self.widget is None:
            self.labels = [widgets.HTML() for _ in states]
            self.clock = widgets.HTML()
            self.widget = widgets.HBox(
                [*self.labels, self.clock], layout=widgets.Layout(flex_flow="row wrap")
            )
            display(self.widget)
        for r, (label, state) in enumerate(zip(self.labels, states)):
            color = "#2e7d32" if "✓" in state else "#c62828" if "✗" in state else "#444"
            label.value = (
                f"<span style='font-family:monospace;margin-right:1.2em;color:{color}'>"
                f"rank {r}: {state}</span>"
            )
        self.clock.value = f"<span style='font-family:monospace;color:#888'>{time.monotonic() - self.t0:.0f} s</span>"

    def clear_line(self) -> None:
        """In a terminal, wipe the status line before a rank's output is printed over it."""
        if self.mode == "line" and self.last:
            sys.stdout.write("\r\x1b[K")

    def finish(self, outcome: dict[int, str]) -> None:
        """Show the end: ``outcome[rank]`` is ``"done"``, ``"failed"`` or ``"stopped"``."""
        self.final = {r: describe((state, 0, None)) for r, state in outcome.items()}
        if self.mode == "off" or (self.widget is None and self.last == 0.0):
            return  # a short run: nothing was shown, nothing to close
        self.update(force=True)
        if self.mode == "line":
            sys.stdout.write("\n")
            sys.stdout.flush()


__all__ = ["Progress", "describe"]
