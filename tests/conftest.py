"""Shared fixtures: a private runs root per test and helpers to check for leftover processes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

# Every rank the tests (and the notebooks nbval runs from this session) start checks that the
# tensors it makes live on its device: on this CPU machine, the bugs a GPU node would reveal.
os.environ.setdefault("COURSE_CHECK_DEVICES", "1")
# The notebooks name the 'distributed-course' kernel: find this environment's registration first
# (make does the same), so that nbval runs them with this checkout's Python.
_kernels = os.path.join(sys.prefix, "share", "jupyter")
if _kernels not in os.environ.get("JUPYTER_PATH", "").split(os.pathsep):
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        filter(None, [_kernels, os.environ.get("JUPYTER_PATH")])
    )


# A test run started in the background of a non-interactive shell (`cmd &`, as some CI harnesses
# do) inherits SIGINT ignored, and Python then leaves it ignored: the tests that press Ctrl-C
# (SIGINT to this process, as Jupyter's interrupt does) would see nothing. Give SIGINT its usual
# meaning, KeyboardInterrupt, as in a terminal or a notebook kernel.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def runs_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("COURSE_RUNS_DIR", str(root))
    return root


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids, within: float = 5.0) -> list[int]:
    """Return the pids still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.05)
    return alive


def only_run_dir(root: Path) -> Path:
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(runs) == 1, runs
    return runs[0]


def rank_pids(run_dir: Path) -> list[int]:
    return list(json.loads((run_dir / "launch.json").read_text())["pids"].values())


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), read from /proc."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent_of.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` holds in the LISTEN state."""
    import ipaddress
    import socket

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = str(ipaddress.ip_address(raw if family == socket.AF_INET6 else raw[:4]))
            out.append((addr, int(hex_port, 16)))
    return out


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"
)


BUSY = "while True: pass"


@pytest.fixture(scope="module")
def busy_cores():
    """Two processes that spin forever, each wanting a whole core, like other users' jobs on a
    shared node: the contended tests run beside them (make test-contended)."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="session")
def hub_env():
    """``make hub-env`` once per session, for test_setup_env's checks of the shared environment and
    for test_hub's real JupyterHub: a stand-in for a site's torch module (torch and numpy linked
    from this environment), ``USE_SYSTEM_TORCH=1``, the kernel under its own ``KERNEL_PREFIX`` and a
    ``DATA_DIR``, all in a 0755 folder under /tmp (not under /root), built from a Python every user
    can run (Debian's ``/usr/bin/python3`` where it exists); the stand-in's files are hard links,
    which other users can read whatever the permissions of this checkout's path. The result is a dict of paths and the
    ``make`` process; the folder is removed at the end of the session."""
    import shutil
    import subprocess
    import tempfile

    from tests.test_setup_env import base_python, make_site, site_env

    top = Path(tempfile.mkdtemp(prefix="crs-hubenv-"))
    top.chmod(0o755)
    python = SYSTEM_PYTHON if os.access(SYSTEM_PYTHON, os.X_OK) else base_python()
    site = make_site(top / "site-packages", ("torch", "numpy"), hardlink=True)
    prefix, kernels, data = top / "shared" / "distributed-course", top / "kernels", top / "data"
    env = site_env(site) | {"JUPYTER_PATH": "", "JUPYTER_DATA_DIR": str(top / "nouser")}
    made = subprocess.run(
        ["make", "-C", str(Path(__file__).resolve().parents[1]), "hub-env", f"PREFIX={prefix}",
         f"KERNEL_PREFIX={kernels}", "USE_SYSTEM_TORCH=1", f"PYTHON={python}",
         f"DATA_DIR={data}"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    yield {"top": top, "site": site, "prefix": prefix, "kernels": kernels, "data": data,
           "python": python, "env": env, "made": made}  # fmt: skip
    shutil.rmtree(top, ignore_errors=True)
