"""``make course``: execute every notebook headless, keep executed copies and HTML.

    python -m course_utils course --out build [--size cpu] [--only 01]

Each notebook runs in a fresh Jupyter kernel from the ``notebooks/`` folder;
``build/NAME.ipynb`` and ``build/NAME.html`` are written even when a cell
fails (the failing cell shows its traceback). The printed table is what an
instructor checks before a session.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def find_notebooks(folder: Path | None = None, only: list[str] | None = None) -> list[Path]:
    found = sorted((folder or NOTEBOOK_DIR).glob("[0-9][0-9]_*.ipynb"))
    if only:
        found = [nb for nb in found if any(nb.name.startswith(o) or o in nb.stem for o in only)]
    return found


def execute(nb_path: Path, out_dir: Path, timeout: int = 1800) -> tuple[str, float, str]:
    """Run one notebook; return (status, seconds, error summary)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbconvert import HTMLExporter

    nb = nbformat.read(nb_path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
        resources={"metadata": {"path": str(nb_path.parent)}},
    )
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        client.execute()
    except CellExecutionError as e:
        status, error = "FAILED", str(e).strip().splitlines()[-1][:200]
    except Exception as e:  # kernel died, timeout: still write what ran
        status, error = "FAILED", f"{type(e).__name__}: {e}"[:200]
    seconds = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / nb_path.name)
    html, _ = HTMLExporter().from_notebook_node(nb)
    (out_dir / nb_path.with_suffix(".html").name).write_text(html, encoding="utf-8")
    return status, seconds, error


def main(
    out: str = "build", size: str | None = None, only: list[str] | None = None, timeout: int = 1800
) -> int:
    if size:
        os.environ["COURSE_SIZE"] = size  # inherited by every kernel
    from .sizes import get_size

    notebooks = find_notebooks(only=only)
    if not notebooks:
        print(f"no notebooks matched under {NOTEBOOK_DIR} (only={only})")
        return 1
    out_dir = Path(out).resolve()
    print(f"Executing {len(notebooks)} notebook(s) at size '{get_size().name}' into {out_dir}")
    rows = []
    for nb in notebooks:
        print(f"  running {nb.name} ...", flush=True)
        rows.append((nb.stem, *execute(nb, out_dir, timeout)))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'notebook':<{width}}  status  seconds")
    for name, status, seconds, error in rows:
        print(f"{name:<{width}}  {status:<6}  {seconds:7.1f}" + (f"  {error}" if error else ""))
    print(f"\nExecuted notebooks and HTML: {out_dir}")
    return 0 if all(r[1] == "ok" for r in rows) else 1
