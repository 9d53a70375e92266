"""Starting rank processes: a forkserver with torch preloaded, or plain spawn.

Why not ``fork``: a forked child deadlocks in OpenMP when the parent already
ran a multithreaded matmul, and CUDA cannot be used after fork. Why not only
``spawn``: every spawned rank re-imports torch (1.3–1.6 s each, serialised on
a 2-core node), and students launch dozens of times per notebook.

The forkserver is a fresh interpreter (started the spawn way) that imports
torch once and never runs a kernel, touches CUDA or starts OpenMP; each rank is
forked from it. That keeps spawn's safety and pays the torch import once per
notebook kernel instead of once per rank per launch.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.spawn as mp_spawn
import socket

import torch.multiprocessing as tmp

START_METHODS = ("auto", "forkserver", "spawn")
# DTensor (torch.distributed.tensor) takes seconds to import, which every rank of notebooks 06-08
# would otherwise pay on every launch; it starts no thread and touches no device.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "cloudpickle",
    "course_utils.launcher.rank",
]


def get_context(start_method: str = "auto") -> multiprocessing.context.BaseContext:
    if start_method == "fork":
        raise ValueError(
            "start_method='fork' is not supported: a forked rank deadlocks in OpenMP after the "
            "parent ran a multithreaded op and cannot use CUDA. Use 'auto' (forkserver) or 'spawn'."
        )
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if start_method == "auto":
        available = multiprocessing.get_all_start_methods()
        start_method = "forkserver" if "forkserver" in available else "spawn"
    ctx = tmp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextlib.contextmanager
def no_main_reimport():
    """Stop new ranks from re-importing the parent's ``__main__``.

    multiprocessing re-runs the parent's main module in every child so that
    functions defined there can be found by name. Ranks get their worker by
    value (cloudpickle), so that import is pure cost: in a notebook it imports
    the whole Jupyter kernel machinery per rank, and in a script without an
    ``if __name__ == "__main__":`` guard it would run the script again.
    """
    original = mp_spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
        return data

    mp_spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


def loopback_listener() -> socket.socket:
    """A TCP socket bound and listening on 127.0.0.1, on a port the kernel picked.

    Bound here, in the launcher, and handed to rank 0: the port is reserved from this moment (no
    race with another student's launch) and can never be opened on another interface.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def loopback_ifname() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), for GLOO_SOCKET_IFNAME."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in names:
        if name.startswith("lo"):
            return name
    return None
