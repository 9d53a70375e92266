"""``make course``: execute every notebook headless, keep executed copies and HTML.

    python -m course_utils course --out build [--size cpu] [--only 01]

Each notebook runs in a fresh Jupyter kernel from the ``notebooks/`` folder;
``build/NAME.ipynb`` and ``build/NAME.html`` are written even when a cell
fails (the failing cell shows its traceback). The printed table is what an
instructor checks before a session.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..sizes import get_size


def _notebook_dir() -> Path:
    """The course's notebooks: ``$COURSE_NOTEBOOKS``, else the checkout's ``notebooks/``, else
    the copy a shared hub environment keeps in ``<venv>/share/distributed-course/notebooks``."""
    if os.environ.get("COURSE_NOTEBOOKS"):
        return Path(os.environ["COURSE_NOTEBOOKS"])
    checkout = Path(__file__).resolve().parents[2] / "notebooks"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "distributed-course" / "notebooks"


NOTEBOOK_DIR = _notebook_dir()


NOTEBOOK_NAME = re.compile(r"^(\d\d[a-z]?)_\w+\.ipynb$")
"""A course notebook: two digits, maybe a letter (``03b``: a second notebook on 03's topic), ``_``."""


def notebook_number(name: str) -> str:
    """``"03b"`` for ``03b_ddp_in_practice``: the prefix of its exercises' numbers (``03b.1``)."""
    m = re.match(r"^(\d\d[a-z]?)_", Path(name).name)
    if not m:
        raise ValueError(f"{name!r} is not a course notebook name (NN_title or NNx_title)")
    return m.group(1)


def find_notebooks(folder: Path | None = None, only: list[str] | None = None) -> list[Path]:
    """The course's notebooks in ``folder``, in teaching order (``03_…`` before ``03b_…``)."""
    found = sorted(
        (p for p in (folder or NOTEBOOK_DIR).glob("*.ipynb") if NOTEBOOK_NAME.match(p.name)),
        key=lambda p: (notebook_number(p.name)[:2], notebook_number(p.name)[2:], p.name),
    )
    if only:
        found = [nb for nb in found if any(nb.name.startswith(o) or o in nb.stem for o in only)]
    return found


class _Where:
    """Where a run is inside a notebook: ``cell k of n``, rewritten in place in a terminal."""

    def __init__(self, name: str, cells: int, stream=None):
        self.name, self.cells = name, cells
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self.count = 0

    def cell(self, cell_index: int | None = None, **_) -> None:
        """nbclient's ``on_cell_start`` hook: called for every cell, markdown included."""
        self.count = self.count + 1 if cell_index is None else cell_index + 1
        now = time.perf_counter()
        line = f"  {self.name}: cell {self.count} of {self.cells}, {now - self.t0:.0f} s"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
        elif now - self.last > 30:  # a log file: a line every half minute at most
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last = now

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def error_summary(e, width: int = 240) -> str:
    """One line for a failed cell: ``AssertionError: the message``; for an assertion without a
    message, the line that failed (``---> 48 assert any(...)``), colour codes removed."""
    name = getattr(e, "ename", type(e).__name__)
    value = _ANSI.sub("", str(getattr(e, "evalue", "") or "")).strip()
    if not value:
        arrows = [
            line.strip()
            for line in _ANSI.sub("", str(getattr(e, "traceback", "") or "")).splitlines()
            if line.lstrip().startswith("--->") or line.lstrip().startswith("---->")
        ]
        value = arrows[-1] if arrows else ""
    return f"{name}: {value}"[:width] if value else name


def execute(
    nb_path: Path,
    out_dir: Path,
    timeout: int = 1800,
    *,
    html: bool = True,
    on_cell: Callable[[int], None] | None = None,
) -> tuple[str, float, str]:
    """Run one notebook; return (status, seconds, error summary).

    The kernel's own output (debugger and transport warnings) and nbclient's log go to
    ``out_dir/logs/NAME.kernel.log``, not into the table. ``html=False`` writes only the executed
    ``.ipynb`` (nbconvert need not be installed); ``on_cell(index)`` is called as each cell starts.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(nb_path, as_version=4)
    where = _Where(nb_path.stem, len(nb.cells))

    def cell_started(cell_index: int | None = None, **kw) -> None:
        where.cell(cell_index=cell_index, **kw)
        if on_cell is not None and cell_index is not None:
            on_cell(cell_index)

    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = open(logs / f"{nb_path.stem}.kernel.log", "w")  # noqa: SIM115 - closed below
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
        resources={"metadata": {"path": str(nb_path.parent)}},
        on_cell_start=cell_started,
    )
    handler = logging.StreamHandler(log_file)
    client.log.addHandler(handler)
    client.log.propagate = False
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        client.execute(stdout=log_file, stderr=log_file)
    except CellExecutionError as e:
        status, error = "FAILED", f"cell {where.count}: {error_summary(e)}"
    except Exception as e:  # kernel died, timeout: still write what ran
        status, error = "FAILED", f"{type(e).__name__}: {e}"[:200]
    finally:
        where.done()
        client.log.removeHandler(handler)
        log_file.close()
    seconds = time.perf_counter() - t0
    nbformat.write(nb, out_dir / nb_path.name)
    if html:
        from nbconvert import HTMLExporter

        page, _ = HTMLExporter().from_notebook_node(nb)
        (out_dir / nb_path.with_suffix(".html").name).write_text(page, encoding="utf-8")
    return status, seconds, error


def main(
    out: str = "build", size: str | None = None, only: list[str] | None = None, timeout: int = 1800
) -> int:
    if size:
        os.environ["COURSE_SIZE"] = size  # inherited by every kernel

    notebooks = find_notebooks(only=only)
    if not notebooks:
        print(f"no notebooks matched under {NOTEBOOK_DIR} (only={only})")
        return 1
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"Executing {len(notebooks)} notebook(s) at size '{get_size().name}' into {out_dir}")
    rows = []
    for nb in notebooks:
        print(f"  running {nb.name} ...", flush=True)
        rows.append((nb.stem, *execute(nb, out_dir, timeout)))
        print(f"    {rows[-1][1]} in {rows[-1][2]:.1f} s", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'notebook':<{width}}  status  seconds")
    for name, status, seconds, error in rows:
        print(f"{name:<{width}}  {status:<6}  {seconds:7.1f}" + (f"  {error}" if error else ""))
    print(f"\nExecuted notebooks and HTML: {out_dir} (kernel logs in {out_dir / 'logs'})")
    return 0 if all(r[1] == "ok" for r in rows) else 1
