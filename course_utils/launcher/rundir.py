"""Run directories: one private folder per launch, kept after the run.

Layout of a run dir::

    launch.json            what was launched, by whom, and how it ended
    payload.pkl            the worker and its kwargs, cloudpickled (hence mode 0700)
    rendezvous             FileStore the ranks meet in (no TCP port needed)
    rank{r}.out / .err     everything rank r wrote to stdout / stderr
    rank{r}.result.pkl     rank r's return value, or its exception
    rank{r}.stacks.txt     rank r's Python stacks, dumped when the job hung
"""

from __future__ import annotations

import getpass
import json
import os
import re
import secrets
import stat
import tempfile
import time
from pathlib import Path

RUNS_ENV = "COURSE_RUNS_DIR"


def runs_root() -> Path:
    """Where run dirs go: ``$COURSE_RUNS_DIR``, else a per-user folder on local temp disk.

    Local disk matters: the FileStore rendezvous takes file locks, which are
    slow or broken on some network file systems.
    """
    env = os.environ.get(RUNS_ENV)
    if env:
        return Path(env).expanduser()
    return Path(tempfile.gettempdir()) / f"course_utils-{getpass.getuser()}" / "runs"


def _private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700, or check that an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PermissionError(
            f"{path} belongs to another user; launch stores pickled code there. "
            f"Set {RUNS_ENV} to a folder of your own."
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def new_run_dir(name: str, root: Path | None = None) -> Path:
    """A fresh, private run dir named ``<date>-<time>-<name>-<random>``."""
    root = Path(root) if root is not None else runs_root()
    _private_dir(root.parent if root.name == "runs" else root)
    _private_dir(root)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40] or "run"
    run_dir = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(3)}"
    run_dir.mkdir(mode=0o700)
    return run_dir


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (readers never see half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
