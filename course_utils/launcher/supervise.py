"""The launcher's side of a run: relay output, watch ranks, stop them all on any fault."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path

import cloudpickle

from .errors import RankFailedError, RankTimeoutError
from .groups import signal_group
from .rank import log_path, result_path, stacks_path

SIGNAL_HINTS = {
    signal.SIGKILL: "on Linux this is usually the out-of-memory killer (check `dmesg`; lower the "
    "batch size, the model size or world_size), or someone ran `kill -9`",
    signal.SIGSEGV: "a crash in native code (a torch/NCCL bug, a bad custom kernel, or a corrupt "
    "tensor shared between processes)",
    signal.SIGABRT: "a failed check or uncaught C++ exception in torch, gloo or NCCL; the end of the "
    "rank's .err log usually says which",
    signal.SIGBUS: "often /dev/shm is too small (DataLoader workers share batches through it): "
    "use num_workers=0 or ask for a larger /dev/shm",
    signal.SIGTERM: "something outside the launcher stopped it (a scheduler time limit, another user)",
}


# Lines the profiler (Kineto) and CUDA-less builds print on every profiled run. They stay in
# the rank's .err log; the notebook cell shows only what the student's code printed.
NOISE = re.compile(
    r"^(USDT:|STAGE:|ERROR:\S* .*DeviceProperties\.cpp|WARNING:\S* .*(CuptiActivityApi|DeviceProperties)"
    r"|.*gpuGetDeviceCount failed|.*Profiler clears events at the end of each cycle"
    r"|\s+warnings\.warn\(|\s+_warn_once\()"
)


def not_noise(line: str) -> bool:
    return NOISE.match(line) is None


class Tail:
    """Follow one rank's log file and echo new complete lines with a rank prefix.

    ``before_write`` runs before any echo (the progress line clears itself there).
    """

    def __init__(self, path: Path, prefix: str, stream, line_filter=None, before_write=None):
        self.path, self.prefix, self.stream, self.filter = path, prefix, stream, line_filter
        self.before_write = before_write
        self.pos, self.partial = 0, b""

    def poll(self, final: bool = False) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        self.pos += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        out = [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]
        if self.filter is not None:
            out = [ln for ln in out if self.filter(ln)]
        if out and self.stream is not None:
            if self.before_write is not None:
                self.before_write()
            self.stream.write("".join(f"{self.prefix}{ln}\n" for ln in out))
            self.stream.flush()


def read_record(run_dir: Path, rank: int) -> dict | None:
    path = result_path(run_dir, rank)
    if not path.exists():
        return None
    try:
        return cloudpickle.loads(path.read_bytes())
    except Exception as e:  # a result that cannot be read back is a failure
        return {
            "ok": False,
            "exc_type": type(e).__name__,
            "time": time.time(),
            "message": f"its result file could not be read back: {e}",
            "traceback": "",
        }


def _tail_text(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(text[-lines:])


def stop(procs: dict, grace: float = 1.0) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after ``grace`` seconds; reap them all.

    Groups are signalled even when their rank has exited: a rank killed by a signal may leave
    DataLoader workers or subprocesses behind (:mod:`.groups` says when that is safe).
    """
    started = [p for p in procs.values() if p.pid is not None]
    for p in started:
        signal_group(p.pid, signal.SIGTERM, p.exitcode is None)
    deadline = time.monotonic() + grace
    for p in started:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in started:
        signal_group(p.pid, signal.SIGKILL, p.exitcode is None)
    for p in started:
        p.join(5)


def harvest(procs: dict, run_dir: Path, results: dict, skip: int | None = None) -> None:
    """Keep the results of ranks that saved theirs but had not exited when the others were stopped."""
    for r in procs:
        if r not in results and r != skip:
            record = read_record(run_dir, r)
            if record is not None and record.get("ok"):
                results[r] = record["value"]


def dump_stacks(procs: dict, run_dir: Path, wait_s: float = 2.0) -> dict[int, str]:
    """Ask every live rank for its Python stacks (faulthandler on SIGUSR1) and read them back."""
    alive = {r: p for r, p in procs.items() if p.exitcode is None}
    for p in alive.values():
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(stacks) < len(alive):
        time.sleep(0.05)
        for r in alive:
            text = (
                stacks_path(run_dir, r).read_text(errors="replace")
                if stacks_path(run_dir, r).exists()
                else ""
            )
            if text.strip():
                stacks[r] = text
    return {
        r: stacks.get(r, "(no stack came back: the process did not answer SIGUSR1)") for r in alive
    }


_INTERNAL = re.compile(
    r'File "(<string>|[^"]*(course_utils/launcher/|/multiprocessing/|/runpy\.py|/threading\.py)[^"]*)"'
)


def worker_stack(dump: str) -> str:
    """The worker's part of a faulthandler dump: the rank's main thread, minus the launcher's frames.

    A dump lists every thread; the launcher's watchdog thread and the frames that started the
    worker (``rank_main``, multiprocessing) say nothing about where the worker is stuck.
    """
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    main = next((b for b in blocks if b.startswith("Current thread")), None)
    if main is None:
        return dump.strip()
    lines = main.splitlines()
    frames = [ln for ln in lines[1:] if ln.strip() and not _INTERNAL.search(ln)]
    return "\n".join([lines[0], *frames]) if frames else main


def _failure_message(rank: int, p, record: dict | None, run_dir: Path) -> tuple[str, int | None]:
    if record is not None and not record.get("ok"):
        head = f"rank {rank} raised {record['exc_type']}: {record['message']}"
        return f"{head}\n\n--- traceback from rank {rank} ---\n{record['traceback']}", None
    code = p.exitcode
    if code is not None and code < 0:
        sig = signal.Signals(-code)
        hint = SIGNAL_HINTS.get(sig, "see the rank's log")
        msg = f"rank {rank} was killed by signal {sig.name} ({-code}): {hint}."
        sig_no = -code
    else:
        msg = f"rank {rank} exited with code {code} without returning a result."
        sig_no = None
    err = _tail_text(log_path(run_dir, rank, "err"))
    if err:
        msg += f"\n\n--- end of rank {rank}'s stderr ---\n{err}"
    return msg, sig_no


def supervise(procs: dict, run_dir: Path, timeout: float, tails: list[Tail], progress=None) -> dict:
    """Wait for every rank; return ``{rank: value}`` or raise. Ranks still running when it raises
    (an interrupt) are the caller's to stop: ``launch`` always calls :func:`stop` at the end."""
    results: dict = {}
    deadline = time.monotonic() + timeout
    pending = set(procs)
    try:
        while pending:
            wait([procs[r].sentinel for r in pending], timeout=0.05)
            for t in tails:
                t.poll()
            if progress is not None:
                progress.update()
            failed = []
            for r in sorted(pending):
                if procs[r].exitcode is None:
                    continue
                record = read_record(run_dir, r)
                if record is not None and record.get("ok"):
                    results[r] = record[
                        "value"
                    ]  # a crash *after* the result was saved is not a failure
                    pending.discard(r)
                else:
                    failed.append((record["time"] if record else time.time(), r, record))
            if failed:
                _, rank, record = min(failed)
                stop(procs)
                harvest(procs, run_dir, results, skip=rank)
                msg, sig = _failure_message(rank, procs[rank], record, run_dir)
                others = sorted(set(procs) - {rank} - set(results))
                msg += (
                    f"\n\nThe other ranks were stopped ({others or 'none left'}); finished ranks "
                    f"{sorted(results) or 'none'} kept their results. Logs: {run_dir}"
                )
                raise RankFailedError(
                    msg,
                    rank,
                    run_dir,
                    results,
                    sig,
                    exc_type=record.get("exc_type") if record else None,
                    exc_message=record.get("message") if record else None,
                )
            if time.monotonic() > deadline:
                stacks = dump_stacks({r: procs[r] for r in pending}, run_dir)
                stop(procs)
                harvest(procs, run_dir, results)
                text = "\n".join(
                    f"--- rank {r} ---\n{worker_stack(s)}" for r, s in sorted(stacks.items())
                )
                raise RankTimeoutError(
                    f"ranks {sorted(stacks)} were still running after timeout={timeout:g}s and were "
                    "stopped. A mismatched collective (one rank calls all_reduce, another does not, or "
                    "with another shape) hangs like this; so does a long run: pass a larger timeout=. "
                    f"Python stacks at that moment:\n{text}\n\nLogs: {run_dir}",
                    stacks,
                    run_dir,
                    results,
                )
    finally:
        for t in tails:
            t.poll(final=True)
    return results


def interrupted_notice(n: int, run_dir: Path) -> None:
    print(
        f"launch: interrupted; all {n} ranks were stopped. Logs and finished results: {run_dir}",
        file=sys.stderr,
    )
