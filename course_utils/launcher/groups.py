"""Process groups: how a run stops everything it started, and only that.

Each rank calls ``os.setsid()`` first thing, so it leads a process group whose id is its pid, and
every process it starts (DataLoader workers, ``subprocess.Popen`` children, their children) joins
that group unless it leaves on purpose.

- While a rank lives, its group id is its own pid: signalling the group is safe.
- A rank that ends by itself (it returned, or raised) kills the rest of its group first
  (:func:`kill_rest_of_my_group`): nothing it started outlives it.
- A rank that was killed (the OOM killer's SIGKILL) cannot; its leftovers keep the group alive.
  A group id cannot be handed to a new process while any member lives, but once the group is
  empty the number is free again (this container recycles pids below 32768). So the launcher
  signals a dead rank's group only after seeing, on Linux, that members remain
  (:func:`signal_group`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def group_members(pgid: int) -> list[int] | None:
    """Pids whose process group is ``pgid`` (read from /proc), or ``None`` where /proc is absent."""
    if not os.path.isdir("/proc/self"):
        return None
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            members.append(int(entry))
    return members


def kill_rest_of_my_group() -> None:
    """SIGKILL every other process in this process's group (a rank's leftovers), not itself."""
    me = os.getpid()
    if os.getpgid(0) != me:
        return  # not a group leader: not a launched rank
    members = group_members(me)
    if members is None:  # no /proc: signal the group while ignoring the signal here
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            os.killpg(me, signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
        return
    for pid in members:
        if pid != me:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def signal_group(pid: int, sig: int, leader_alive: bool) -> None:
    """Send ``sig`` to the group a rank (``pid``) leads: the rank and everything it started.

    Until a rank has called ``setsid`` (one stopped in its first microseconds) there is no group,
    and the rank alone is signalled; it has started nothing yet.
    """
    if not leader_alive:
        members = group_members(pid)
        if members is not None and not members:
            return  # an empty group: its id may already be someone else's
    try:
        os.killpg(pid, sig)
        return
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    if leader_alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


__all__ = ["group_members", "kill_rest_of_my_group", "signal_group"]
if sys.platform == "win32":  # pragma: no cover - the course runs on Linux and macOS
    raise ImportError("course_utils.launcher needs POSIX process groups")
