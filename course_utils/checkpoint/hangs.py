"""Hangs: a collective the ranks do not all call alike, what reports it, and the flight recorder.

A collective completes only when every rank of the group calls it with the same op and sizes. When
rank 0 calls an ``all_reduce`` that rank 1 skips, or calls with another size or op, nothing fails
at once: the ranks wait. Two timeouts end the wait, and the flight recorder says which call it was:

- ``launch``'s own ``timeout`` (:func:`mismatch`): it raises
  :class:`~course_utils.launcher.errors.RankTimeoutError` with every rank's Python stack at that
  moment (:func:`stuck_at` reads the worker's line from it);
- the process group's timeout (``init_process_group(timeout=...)``, :func:`mismatch` with
  ``pg_timeout``): gloo gives up waiting for its peer and raises in the rank ("Timed out waiting
  3000ms for recv operation to complete"), which ``launch`` reports as a
  :class:`~course_utils.launcher.errors.RankFailedError`;
- :func:`flight_record`: PyTorch's flight recorder, a ring buffer of the last collectives each rank
  issued (op, sizes, sequence number, state), dumped per rank and compared by
  :func:`first_disagreement`: the first sequence number where the ranks' records differ is the
  mismatched call, and the stack the recorder kept names its line in each rank.

**The flight recorder on gloo** (torch 2.14.1, observed in :func:`flight_record`'s tests). Gloo
records its collectives natively into the generic recorder, on by default (``TORCH_FR_BUFFER_SIZE``,
or ``TORCH_NCCL_TRACE_BUFFER_SIZE``, default 2000 entries; 0 turns it off), read with
``torch._C._distributed_c10d._dump_fr_trace`` (a pickle, with Python stacks) or
``_dump_fr_trace_json``; ``_dump_nccl_trace_json`` is NCCL's own recorder and holds no entry on
gloo. Each record has the op (``gloo:all_reduce``), input and output sizes and dtypes, the
collective sequence number per group and ``retired``; the state stays ``scheduled`` (gloo gives
the recorder no start or end events) and ``retired`` turns true when the work completes (the
collective that timed out was not yet retired when :func:`flight_worker` dumped, in notebook 11's
runs). Sends and recvs are not recorded. A gloo rank stuck in a collective cannot dump (its
thread waits): the process group's timeout has to end the wait first, as here; NCCL's watchdog
thread instead dumps on a timeout by itself (``TORCH_NCCL_DUMP_ON_TIMEOUT``).

Taught in notebook 11.
"""

from __future__ import annotations

import os
import pickle
import re
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import launcher
from ..launcher import LaunchError, launch

D = torch.float64
KINDS = ("op", "size", "skip")


def _own_group(ctx, pg_timeout: float) -> None:
    """The default process group made by the worker, with its own timeout (``launch`` makes one
    with a timeout longer than its own otherwise)."""
    timeout = timedelta(seconds=pg_timeout)
    dist.init_process_group(
        "gloo",
        init_method=ctx.init_method,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timeout,
    )


def collectives_then_mismatch(ctx, kind: str = "op") -> None:
    """Two matched collectives, then one that rank 0 and the others call differently: rank 0 an
    ``all_reduce`` of 4 elements; the others a ``broadcast`` (``"op"``), an ``all_reduce`` of 8
    (``"size"``), or none (``"skip"``: they wait in a ``recv`` from rank 0, which never sends)."""
    t = torch.ones(4, dtype=D, device=ctx.device)  # (4,)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    if ctx.rank == 0:
        dist.all_reduce(t)  # rank 0 waits here
    elif kind == "op":
        dist.broadcast(t, src=1)  # the others wait here (op)
    elif kind == "size":
        dist.all_reduce(torch.ones(8, dtype=D, device=ctx.device))  # the others here (size)
    else:
        dist.recv(t, src=0)  # the others wait here (skip)


def mismatched_worker(ctx, kind: str = "op", pg_timeout: float | None = None) -> str:
    """:func:`collectives_then_mismatch`, in a process group of its own when ``pg_timeout``."""
    if pg_timeout is not None:
        _own_group(ctx, pg_timeout)
    collectives_then_mismatch(ctx, kind)
    return "the mismatched collective completed"


@dataclass
class Hang:
    """How a mismatch ended: the error ``launch`` raised, the seconds it took, and per rank the
    worker's innermost line in its stack (``file:line in function``; only a
    :class:`RankTimeoutError` holds stacks, so otherwise empty)."""

    error: LaunchError
    seconds: float
    where: dict[int, str | None]


def stuck_at(stack: str, module: str = __file__) -> str | None:
    """The innermost frame of ``stack`` (a faulthandler dump, innermost first) in ``module``'s
    file: ``"hangs.py:62 in collectives_then_mismatch"``."""
    name = os.path.basename(module)
    for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', stack):
        if os.path.basename(m.group(1)) == name:
            return f"{name}:{m.group(2)} in {m.group(3)}"
    return None


def mismatch(kind: str = "op", timeout: float = 5.0, pg_timeout: float | None = None,
             echo: bool = False) -> Hang:  # fmt: skip
    """Launch :func:`mismatched_worker` on 2 ranks and return how it ended.

    ``pg_timeout=None``: the process group's timeout is longer than launch's ``timeout``, so launch
    ends a hang with a :class:`RankTimeoutError` and every rank's stack. ``pg_timeout`` seconds:
    gloo gives up first, raises in the ranks, and launch reports a :class:`RankFailedError`. On
    gloo a size mismatch need not hang at all: the rank that receives more bytes than it expects
    aborts (SIGABRT, "Received data size doesn't match expected size")."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    t0 = time.monotonic()
    try:
        launch(mismatched_worker, 2, timeout=timeout, echo=echo, kind=kind, pg_timeout=pg_timeout,
               init_process_group=pg_timeout is None)  # fmt: skip
    except LaunchError as e:
        stacks = getattr(e, "stacks", {})
        return Hang(e, time.monotonic() - t0, {r: stuck_at(s) for r, s in stacks.items()})
    raise RuntimeError(f"the mismatched collective ({kind}) completed on every rank")


# --- the flight recorder ---------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """One collective (or send/recv, on NCCL) in a rank's flight recorder, as its dump gives it."""

    pg: str
    """The process group's name (``"0"``: the default group)."""
    seq: int
    """``collective_seq_id``: the n-th collective this rank issued in that group (p2p ops: 0)."""
    p2p_seq: int
    op: str
    """``profiling_name``: ``"gloo:all_reduce"``, ``"nccl:broadcast"``…"""
    input_sizes: tuple
    output_sizes: tuple
    dtypes: tuple
    state: str
    """``scheduled``, ``started`` or ``completed``; gloo's records stay ``scheduled``."""
    retired: bool
    """The backend let go of the work: it completed (on gloo, a collective that timed out was not
    yet retired when its rank dumped right after the error)."""
    p2p: bool
    """A send or recv (numbered by ``p2p_seq``), not a collective."""
    where: str | None = None
    """The call's innermost line outside torch (``file:line in function``), from the stack the
    recorder kept."""

    @classmethod
    def from_entry(cls, e: dict) -> Record:
        def sizes(v):
            return tuple(tuple(s) for s in v)

        return cls(str(e["process_group"][0]), e["collective_seq_id"], e["p2p_seq_id"],
                   e["profiling_name"], sizes(e["input_sizes"]), sizes(e["output_sizes"]),
                   tuple(e["input_dtypes"]), e["state"], e["retired"], e["is_p2p"],
                   _caller(e.get("frames", [])))  # fmt: skip

    def call(self) -> tuple:
        """What every rank must agree on: the op and the sizes."""
        return self.op, self.input_sizes, self.output_sizes


# torch's code, and the launcher's device check (it wraps torch functions in the ranks)
_NOT_CALLERS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, launcher))


def _caller(frames: list[dict]) -> str | None:
    """The innermost of ``frames`` (innermost first) outside torch and the launcher."""
    for f in frames:
        if not f["filename"].startswith(_NOT_CALLERS):
            return f"{os.path.basename(f['filename'])}:{f['line']} in {f['name']}"
    return None


def dump() -> dict:
    """This process's flight recorder, completed collectives included, with each record's Python
    stack (``frames``): ``torch._C._distributed_c10d._dump_fr_trace`` (a pickle of this very
    process's records; ``_dump_fr_trace_json`` gives the same without the stacks). Keys:
    ``entries``, ``pg_config``, ``pg_status`` (per group the last collective enqueued, started,
    completed), ``version``."""
    from torch._C import _distributed_c10d as c10d

    if not hasattr(c10d, "_dump_fr_trace"):  # torch 2.6: NCCL's recorder only (_dump_nccl_trace)
        return {"missing": True}
    return pickle.loads(c10d._dump_fr_trace(True, True, False))


def flight_worker(ctx, kind: str = "op", pg_timeout: float = 3.0, buffer: int | None = None):
    """Record a few collectives and a mismatched one, then dump: ``{"error", "dump"}``.

    ``buffer``: ``TORCH_FR_BUFFER_SIZE`` (entries kept; 0 turns the recorder off), set before
    the process group exists: the recorder reads it once, when first used."""
    if buffer is not None:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(buffer)
    _own_group(ctx, pg_timeout)
    try:
        collectives_then_mismatch(ctx, kind)
        error = None
    except RuntimeError as e:  # gloo: "Timed out waiting ...ms for recv operation to complete"
        error = str(e)
    return {"error": error, "dump": dump()}


@dataclass
class FlightRecord:
    """Every rank's flight-recorder dump after a mismatch."""

    records: dict[int, list[Record]]
    errors: dict[int, str | None]
    """What the mismatched call raised in each rank (gloo's timeout), or ``None``."""
    status: dict[int, dict]
    """Per rank ``pg_status``: per group ``last_enqueued_collective``, ``..._completed_...``."""
    note: str
    """What was recorded, in a sentence; says so when nothing was."""


def flight_record(kind: str = "op", pg_timeout: float = 3.0, buffer: int | None = None,
                  echo: bool = False) -> FlightRecord:  # fmt: skip
    """Launch :func:`flight_worker` on 2 ranks (gloo) and read back every rank's records.

    ``kind``: ``"op"`` or ``"skip"`` (a ``"size"`` mismatch aborts a gloo rank before it can
    dump, and the launch raises)."""
    res = launch(flight_worker, 2, timeout=pg_timeout + 60, echo=echo, init_process_group=False,
                 kind=kind, pg_timeout=pg_timeout, buffer=buffer).results  # fmt: skip
    records = {r: [Record.from_entry(e) for e in v["dump"].get("entries", [])]
               for r, v in enumerate(res)}  # fmt: skip
    n = sum(map(len, records.values()))
    if any(v["dump"].get("missing") for v in res):
        note = (f"torch {torch.__version__} has no flight recorder for gloo (only NCCL's, "
                "torch._C._distributed_c10d._dump_nccl_trace); torch 2.14.1 records gloo's "
                "collectives too")  # fmt: skip
    else:
        note = (f"{n} records from {len(res)} ranks (torch {torch.__version__}, gloo)" if n else
                f"the flight recorder recorded nothing on gloo (torch {torch.__version__}, "
                f"TORCH_FR_BUFFER_SIZE={buffer if buffer is not None else 'unset'})")  # fmt: skip
    errors = {r: v["error"] for r, v in enumerate(res)}
    return FlightRecord(records, errors, {r: v["dump"].get("pg_status", {}) for r, v in
                                          enumerate(res)}, note)  # fmt: skip


@dataclass
class Disagreement:
    """The first collective of group ``pg`` the ranks did not call alike: ``calls[rank]`` is each
    rank's record of collective number ``seq`` (``None``: that rank never called it)."""

    pg: str
    seq: int
    calls: dict[int, Record | None]

    def __str__(self) -> str:
        said = [f"rank {r}: {c.op} {list(map(list, c.input_sizes))} at {c.where}" if c
                else f"rank {r}: nothing" for r, c in sorted(self.calls.items())]  # fmt: skip
        return f"collective {self.seq} of group {self.pg}: " + "; ".join(said)


def first_disagreement(records: dict[int, list[Record]]) -> Disagreement | None:
    """The first collective, by sequence number, whose records differ between ranks (op or sizes)
    or that some rank lacks; ``None`` when all agree. Sequence numbers older than some rank's
    oldest record (the ring buffer overwrote them there) are not compared."""
    groups = sorted({x.pg for recs in records.values() for x in recs})
    for pg in groups:
        per = {
            r: {x.seq: x for x in recs if x.pg == pg and not x.p2p} for r, recs in records.items()
        }
        oldest = max((min(s) for s in per.values() if s), default=0)
        for seq in sorted({s for got in per.values() for s in got if s >= oldest}):
            calls = {r: got.get(seq) for r, got in per.items()}
            if None in calls.values() or len({c.call() for c in calls.values()}) > 1:
                return Disagreement(pg, seq, calls)
    return None
