"""Run directories: one private folder per launch, kept after the run.

Layout of a run dir::

    launch.json            what was launched, by whom, and how it ended
    payload.pkl            the worker and its kwargs, cloudpickled (hence mode 0700);
                           never the environment, which reaches the ranks through memory
    rendezvous             FileStore the ranks meet in (no TCP port needed)
    rank{r}.out / .err     everything rank r wrote to stdout / stderr
    rank{r}.result.pkl     rank r's return value, or its exception
    rank{r}.stacks.txt     rank r's Python stacks, dumped when the job hung

Safety on a shared node (a JupyterHub with one ``/tmp`` for everyone):

- the folders launch owns (``course_utils-$USER`` and ``runs`` under the temp dir, or
  ``$COURSE_RUNS_DIR`` and whatever of it launch creates) are opened one component at a time
  with ``O_NOFOLLOW``: a symlink planted there by someone else is refused, never followed;
- an existing folder must belong to this user and be writable by nobody else; its mode is
  never changed. Only folders launch creates get ``chmod 0700``;
- the folder holding them must belong to this user or to root (its owner can rename anything in
  it), and must not let others rename them: not writable by others, or sticky like ``/tmp``.
"""

from __future__ import annotations

import contextlib
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


class RunDirError(PermissionError):
    """A runs folder that launch refuses to use, with the reason and the fix."""


def _default_parts() -> tuple[Path, list[str]]:
    return Path(tempfile.gettempdir()), [f"course_utils-{getpass.getuser()}", "runs"]


def _split_user_path(path: Path) -> tuple[Path, list[str]]:
    """The deepest existing folder above ``path`` (the user's choice, trusted as it is) and the rest.

    ``path`` itself, when it exists, is always in the rest: launch stores code in it, so it is checked.
    """
    path = Path(os.path.abspath(path.expanduser()))
    rest = [path.name]
    base = path.parent
    while not os.path.lexists(base) and base != base.parent:
        rest.insert(0, base.name)
        base = base.parent
    return base, rest


def runs_root(root: str | Path | None = None) -> Path:
    """Where run dirs go: ``root``, else ``$COURSE_RUNS_DIR``, else a per-user folder on local temp disk.

    Local disk matters: the FileStore rendezvous takes file locks, which are
    slow or broken on some network file systems.
    """
    base, parts = _parts(root)
    return base.joinpath(*parts)


def _parts(root: str | Path | None) -> tuple[Path, list[str]]:
    if root is None:
        env = os.environ.get(RUNS_ENV)
        if not env:
            return _default_parts()
        root = env
    return _split_user_path(Path(root))


def _fix(path: Path) -> str:
    return (
        f"Set {RUNS_ENV} to a folder of your own (for example ~/course-runs), or remove {path} "
        "if it is yours."
    )


def _check_owned(fd: int, path: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(
            f"{path} is not a folder; launch keeps its runs in a folder. {_fix(path)}"
        )
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise RunDirError(
            f"{path} belongs to another user (uid {st.st_uid}); launch stores pickled code there and "
            f"will not use a folder someone else controls. {_fix(path)}"
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise RunDirError(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): they could "
            f"replace your runs with their own code. Run `chmod go-w {path}` (or `chmod 700`), or "
            f"set {RUNS_ENV} to another folder."
        )


def _open_dir(name: str, parent_fd: int, path: Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except OSError as e:
        if os.path.islink(path):
            raise RunDirError(
                f"{path} is a symbolic link (to {os.readlink(path)}). launch never follows a link "
                "to its runs folder: on a shared node someone else can plant one to collect your "
                f"code. Point {RUNS_ENV} at the real folder instead. {_fix(path)}"
            ) from None
        raise RunDirError(f"cannot open {path} as a folder ({e}). {_fix(path)}") from None


def _check_base(fd: int, path: Path) -> None:
    """The folder launch's own folders live in: only its owner (and root) may rename them there."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if hasattr(os, "getuid") and st.st_uid not in (0, os.getuid()):
        raise RunDirError(
            f"{path} belongs to another user (uid {st.st_uid}), who can rename anything inside it "
            f"and put a folder of their own in its place. Set {RUNS_ENV} to a folder under your "
            "home directory."
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise RunDirError(
            f"{path} is writable by other users and not sticky (mode {mode:04o}): anyone could "
            f"rename your runs folder inside it and put their own in its place. Set {RUNS_ENV} to "
            "a folder under your home directory."
        )


@contextlib.contextmanager
def _private_root(root: str | Path | None = None):
    """Open (creating what is missing) the runs root safely; yield ``(path, fd)``."""
    base, parts = _parts(root)
    if os.name != "posix":  # no dir_fd / O_NOFOLLOW: plain creation, as before
        path = base.joinpath(*parts)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        yield path, None
        return
    fd = os.open(base, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _check_base(fd, base)
        path = base
        for name in parts:
            path = path / name
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            child = _open_dir(name, fd, path)
            os.close(fd)
            fd = child
            _check_owned(fd, path)
            if created:
                os.fchmod(fd, 0o700)  # ours: private whatever the umask says
        yield path, fd
    finally:
        os.close(fd)


def new_run_dir(name: str, root: str | Path | None = None) -> Path:
    """A fresh, private run dir named ``<date>-<time>-<name>-<random>``."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40] or "run"
    run_name = f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(3)}"
    with _private_root(root) as (path, fd):
        if fd is None:
            (path / run_name).mkdir(mode=0o700)
        else:
            os.mkdir(run_name, 0o700, dir_fd=fd)
            run_fd = _open_dir(run_name, fd, path / run_name)
            os.fchmod(run_fd, 0o700)
            os.close(run_fd)
    return path / run_name


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (readers never see half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
