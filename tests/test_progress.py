"""The per-rank progress display: status files, their rendering, and a launch seen from a terminal."""

from __future__ import annotations

import io
import sys
import time

import pytest

from course_utils import RankFailedError, launch
from course_utils.launcher import progress as progress_module
from course_utils.launcher.context import StatusFile, read_status
from course_utils.launcher.progress import Progress, describe


def test_status_file_round_trip(tmp_path):
    path = tmp_path / "rank0.status"
    assert read_status(path) is None and describe(None) == "starting"
    f = StatusFile(path)
    f.write("running")
    assert read_status(path) == ("running", 0, None)
    f.write("step", 3, 10)
    assert read_status(path) == ("step", 3, 10) and describe(read_status(path)) == "step 3/10"
    f.write("step", 4, 10)  # within 0.2 s of the last write: skipped
    assert read_status(path) == ("step", 3, 10)
    f.write("step", 10, 10)  # the last step is always written
    assert describe(read_status(path)) == "step 10/10"
    f.write("done")
    assert describe(read_status(path)) == "done ✓" and describe(("failed", 0, None)) == "failed ✗"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def stepping(ctx, steps, fail=False):
    for _ in range(steps):
        time.sleep(0.5)
        ctx.step(total=steps)
    if fail and ctx.rank == 1:
        time.sleep(1.5)  # rank 0 has returned by then
        raise ValueError("boom")
    return ctx.steps_done


@pytest.mark.multiprocess
def test_terminal_line_shows_steps_then_done(runs_root, monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(progress_module, "_in_jupyter", lambda: False)
    res = launch(stepping, 2, steps=10, echo=False)
    assert res.results == [10, 10]
    text = term.getvalue()
    assert "rank 0: step" in text and "/10" in text, text[-500:]
    final = text.rstrip("\n").split("\r")[-1]
    assert "rank 0: done ✓" in final and "rank 1: done ✓" in final, final


@pytest.mark.multiprocess
def test_failed_rank_is_marked_and_short_runs_show_nothing(runs_root, monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(progress_module, "_in_jupyter", lambda: False)
    with pytest.raises(RankFailedError) as info:
        launch(stepping, 2, steps=8, fail=True, echo=False)
    assert info.value.exc_type == "ValueError" and info.value.exc_message == "boom"
    final = term.getvalue().rstrip("\n").split("\r")[-1]
    assert "rank 1: failed ✗" in final and "rank 0: done ✓" in final, final
    term.seek(0)
    term.truncate()
    short = Progress(runs_root, 2, delay=3.0, mode="line")  # a run that ends within the delay
    short.update()
    short.finish({0: "done", 1: "done"})
    assert term.getvalue() == ""


def test_progress_is_off_without_a_terminal_or_notebook(tmp_path):
    p = Progress(tmp_path, 2, delay=0.0)  # pytest captures stdout: neither a tty nor Jupyter
    assert p.mode == "off"
    p.update(force=True)
    p.finish({0: "done", 1: "done"})


class _TTY(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("has_kernel, mode", [(False, "line"), (True, "widget")])
def test_a_terminal_ipython_gets_the_line_and_a_notebook_the_widget(
    tmp_path, monkeypatch, has_kernel, mode
):
    """`ipython` in a terminal is an IPython shell with no kernel: widgets would print as text
    there (`HBox(children=...)`), so it gets the one-line status; a Jupyter kernel gets widgets."""
    import IPython

    class Shell:  # TerminalInteractiveShell has no .kernel; ZMQInteractiveShell does
        pass

    shell = Shell()
    if has_kernel:
        shell.kernel = object()
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(sys, "stdout", _TTY())
    assert Progress(tmp_path, 2, delay=0.0).mode == mode
