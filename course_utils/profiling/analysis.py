"""Where each rank's time went: compute, communication, data loading, optimizer, idle.

Every recorded step of every rank is cut into elementary time segments, and
each segment gets exactly one class, so the classes add up to the step time:

- CPU ranks (gloo): the training thread is the reference. Precedence:
  data > optimizer > compute > communication > idle. Compute is time inside
  ``cpu_op`` events; ``user_annotation`` labels (``DistributedDataParallel.forward``)
  are not evidence of work, since the thread may be blocked inside them. Communication is the
  gloo threads' collectives plus the training thread's own ``c10d::`` calls;
  the part of it that runs while the training thread computes is *hidden*,
  the rest is *exposed*.
- GPU ranks (NCCL): the device is the reference. Precedence:
  compute > memory > communication > data > optimizer > idle. Compute is every
  kernel except NCCL's; memory is the device's copies and fills (``Memcpy``,
  ``Memset``), which move bytes and compute nothing (Holistic Trace Analysis
  counts them apart the same way); communication is NCCL kernels; data and
  optimizer are the CPU-side annotations while the GPU has nothing to run.
  Kernel-busy time is not model FLOP utilisation: a kernel that waits on
  memory counts as compute here.

Straggler: in synchronous data parallelism every rank waits for the slowest
one inside a collective. Per step, the rank with the most non-communication
work (compute + data + optimizer) is the slowest, and the others waited for
it by the difference. A rank is named *the* straggler only when it is clearly
the slowest in every recorded step (:meth:`Analysis.straggler`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from .trace import MARKER, STEP, Trace, align

CLASSES = ("compute", "memory", "communication", "data", "optimizer", "idle")
COMM = re.compile(r"^(gloo:|nccl:|c10d::|record_param_comms|nccl[A-Z]|ncclDevKernel|ncclKernel)")
DATA = re.compile(r"^(enumerate\(DataLoader\)|data($|[\s_:.#/-]))", re.IGNORECASE)
OPTIMIZER = re.compile(r"^(Optimizer\.(step|zero_grad)#|optimizer($|[\s_:.#/-]))", re.IGNORECASE)
MEMORY = re.compile(r"^(Memcpy|Memset) ")  # a GPU stream's copies and fills (kernel names differ)


WRAPPERS = ("PythonDispatchMode",)
"""Events that are not work of their own: a Python dispatch mode (``course_utils.modelled``, the
checks' watchers) records one inside each op it sees, around a second copy of that op."""


def classify_name(name: str) -> str | None:
    """The class an event name stands for (``None`` for step, marker and wrapper events)."""
    if STEP.match(name) or name == MARKER or name in WRAPPERS:
        return None
    if COMM.match(name):
        return "communication"
    if MEMORY.match(name):
        return "memory"
    if DATA.match(name):
        return "data"
    if OPTIMIZER.match(name):
        return "optimizer"
    return "compute"


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals into sorted, disjoint ones."""
    if len(starts) == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    breaks = s[1:] > e[:-1]
    return s[np.concatenate(([True], breaks))], e[np.concatenate((breaks, [True]))]


def _inside(points: np.ndarray, u: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    s, e = u
    if len(s) == 0:
        return np.zeros(len(points), dtype=bool)
    i = np.searchsorted(s, points, side="right") - 1
    ok = i >= 0
    out = np.zeros(len(points), dtype=bool)
    out[ok] = points[ok] < e[i[ok]]
    return out


@dataclass
class StepBreakdown:
    """One rank's step, in milliseconds. ``compute + memory + communication + data + optimizer +
    idle == step`` (memory: copies and fills on a GPU, nothing on the CPU);
    ``communication`` is the exposed part, ``comm_total`` includes what overlapped with compute."""

    rank: int
    step: int
    start_ms: float
    step_ms: float
    compute: float
    memory: float
    communication: float
    data: float
    optimizer: float
    idle: float
    comm_total: float
    segments: dict
    """class -> (starts, ends) in ms on the common clock, for timelines."""

    @property
    def overlap(self) -> float:
        """Fraction of communication hidden behind other work (0 when there was none)."""
        return 0.0 if self.comm_total <= 0 else 1.0 - self.communication / self.comm_total

    @property
    def busy(self) -> float:
        """Non-communication work: what the other ranks wait for."""
        return self.compute + self.memory + self.data + self.optimizer

    def row(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "rank",
                "step",
                "step_ms",
                "compute",
                "memory",
                "communication",
                "data",
                "optimizer",
                "idle",
                "comm_total",
            )
        } | {"overlap": self.overlap}


def _class_masks(t: Trace) -> dict[str, np.ndarray]:
    cls = np.array([classify_name(n) or "" for n in t.names], dtype=object)[t.name_id]
    return {c: cls == c for c in ("compute", "memory", "communication", "data", "optimizer")}


def analyse_trace(t: Trace) -> list[StepBreakdown]:
    """Break every recorded step of one rank into the five classes."""
    masks = _class_masks(t)
    on_gpu = t.lane_is_gpu[t.lane]
    main = t.lane == t.main_lane
    gpu = t.has_gpu
    # On CPU only ops prove that the thread computed: a user_annotation such as
    # DistributedDataParallel.forward also spans the time its thread sat waiting for a collective.
    is_op = ~t.name_is_annotation[t.name_id]
    sources = {
        "compute": masks["compute"] & (on_gpu if gpu else main & is_op),
        "memory": masks["memory"] & on_gpu,
        "communication": masks["communication"] & (on_gpu if gpu else ~on_gpu),
        "data": masks["data"] & ~on_gpu,
        "optimizer": masks["optimizer"] & ~on_gpu,
    }
    order = (
        ("compute", "memory", "communication", "data", "optimizer")
        if gpu
        else ("data", "optimizer", "compute", "memory", "communication")
    )
    out = []
    for step, s0, s1 in t.steps:
        win = (t.end > s0) & (t.start < s1)
        unions = {
            c: union(np.clip(t.start[m & win], s0, s1), np.clip(t.end[m & win], s0, s1))
            for c, m in sources.items()
        }
        if not gpu:  # the training thread inside a c10d call is communicating, not computing
            comm_main = masks["communication"] & main & win
            if comm_main.any():
                cs, ce = union(
                    np.clip(t.start[comm_main], s0, s1), np.clip(t.end[comm_main], s0, s1)
                )
                unions["compute"] = subtract(unions["compute"], (cs, ce))
        bounds = np.unique(
            np.concatenate([[s0, s1], *[np.concatenate(u) for u in unions.values()]])
        )
        bounds = bounds[(bounds >= s0) & (bounds <= s1)]
        mids, lens = (bounds[:-1] + bounds[1:]) / 2, np.diff(bounds)
        member = {c: _inside(mids, u) for c, u in unions.items()}
        label = np.full(len(mids), "idle", dtype=object)
        for c in reversed(order):  # lowest precedence first, overwritten by higher ones
            label[member[c]] = c
        ms = {c: float(lens[label == c].sum()) / 1e3 for c in CLASSES}
        comm_total = float(lens[member["communication"]].sum()) / 1e3
        segs = {}
        for c in CLASSES:
            sel = label == c
            if sel.any():
                us = union(bounds[:-1][sel], bounds[1:][sel])
                segs[c] = ((us[0] + t.offset) / 1e3, (us[1] + t.offset) / 1e3)
        out.append(
            StepBreakdown(
                rank=t.rank,
                step=step,
                start_ms=(s0 + t.offset) / 1e3,
                step_ms=(s1 - s0) / 1e3,
                comm_total=comm_total,
                segments=segs,
                **ms,
            )
        )
    return out


def subtract(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint intervals ``a`` minus disjoint intervals ``b`` (each a ``(starts, ends)`` pair)."""
    if len(a[0]) == 0 or len(b[0]) == 0:
        return a
    bounds = np.unique(np.concatenate([*a, *b]))
    mids = (bounds[:-1] + bounds[1:]) / 2
    keep = _inside(mids, a) & ~_inside(mids, b)
    return union(bounds[:-1][keep], bounds[1:][keep])


_OP_EVENTS = {
    # c10d's dispatcher op, recorded once per call on the thread that issued it
    "all_reduce": ("c10d::allreduce_",),
    "all_gather": (
        "c10d::allgather_",
        "c10d::_allgather_base_",
        "c10d::allgather_into_tensor_coalesced_",
    ),
    "reduce_scatter": (
        "c10d::reduce_scatter_",
        "c10d::_reduce_scatter_base_",
        "c10d::reduce_scatter_tensor_coalesced_",
    ),
    "broadcast": ("c10d::broadcast_",),
}
_BACKEND_EVENTS = {  # the backend's own label of the same call: counted only when c10d's is absent
    "all_reduce": ("nccl:all_reduce", "gloo:all_reduce"),
    "all_gather": ("nccl:all_gather", "nccl:_all_gather_base", "gloo:all_gather"),
    "reduce_scatter": ("nccl:reduce_scatter", "nccl:_reduce_scatter_base", "gloo:reduce_scatter"),
    "broadcast": ("nccl:broadcast", "gloo:broadcast"),
}
_KERNELS = {
    "all_reduce": re.compile(r"^nccl(DevKernel|Kernel)_AllReduce"),
    "all_gather": re.compile(r"^nccl(DevKernel|Kernel)_AllGather"),
    "reduce_scatter": re.compile(r"^nccl(DevKernel|Kernel)_ReduceScatter"),
    "broadcast": re.compile(r"^nccl(DevKernel|Kernel)_Broadcast"),
}


def collective_events(trace: Trace, op: str) -> np.ndarray:
    """Which events of ``trace`` are ``op`` collectives, where the breakdown counts communication.

    In a trace with a GPU that is NCCL's kernels on the GPU streams: the host's ``c10d::`` and
    ``nccl:`` events only span the microseconds it takes to queue a kernel, not the wait. In a
    CPU trace it is the host's events (c10d's and gloo's), inside which gloo waits. A boolean mask
    over the trace's events.
    """
    if op not in _OP_EVENTS:
        raise ValueError(f"op must be one of {sorted(_OP_EVENTS)}, got {op!r}")
    if trace.has_gpu:
        ids = [i for i, n in enumerate(trace.names) if _KERNELS[op].match(n)]
        return np.isin(trace.name_id, ids) & trace.lane_is_gpu[trace.lane]
    names = _OP_EVENTS[op] + _BACKEND_EVENTS[op]
    return np.isin(trace.name_id, [i for i, n in enumerate(trace.names) if n in names])


def collectives_per_step(trace: Trace, op: str = "all_reduce") -> list[int]:
    """How many ``op`` collectives each recorded step issued, counted on **every** thread.

    On a GPU, DDP's gradient hooks run on the autograd engine's device thread, not the training
    thread (pytorch issue 52020), so a count on the training thread alone reads 0 there. One call
    leaves two CPU events (``c10d::allreduce_`` and the backend's ``gloo:all_reduce`` /
    ``nccl:all_reduce``): c10d's is counted, the backend's only where c10d's is missing, and a
    trace with neither counts NCCL's kernels on the GPU streams. A collective belongs to the step
    in which it starts.
    """
    if op not in _OP_EVENTS:
        raise ValueError(f"op must be one of {sorted(_OP_EVENTS)}, got {op!r}")
    cpu = ~trace.lane_is_gpu[trace.lane]
    chosen = None
    for names in (_OP_EVENTS[op], _BACKEND_EVENTS[op]):
        ids = [i for i, n in enumerate(trace.names) if n in names]
        mask = np.isin(trace.name_id, ids) & cpu
        if mask.any():
            chosen = mask
            break
    if chosen is None:
        ids = [i for i, n in enumerate(trace.names) if _KERNELS[op].match(n)]
        chosen = np.isin(trace.name_id, ids) & ~cpu
    chosen &= ~_nested_copies(trace, chosen)
    return [
        int((chosen & (trace.start >= s0) & (trace.start < s1)).sum()) for _, s0, s1 in trace.steps
    ]


def _nested_copies(trace: Trace, mask: np.ndarray) -> np.ndarray:
    """Events of ``mask`` that lie inside another event of ``mask`` with the same name on the same
    lane: the second record of one call that a Python dispatch mode re-dispatched (notebook 04's
    modelled compute), not a call of their own."""
    out = np.zeros_like(mask)
    idx = np.flatnonzero(mask)
    order = idx[
        np.lexsort((-trace.end[idx], trace.start[idx], trace.name_id[idx], trace.lane[idx]))
    ]
    open_start, open_end, key = -np.inf, -np.inf, None
    for i in order:
        k = (trace.lane[i], trace.name_id[i])
        inside = trace.end[i] <= open_end and (trace.start[i], trace.end[i]) != (
            open_start,
            open_end,
        )
        if (
            k == key and inside
        ):  # strictly inside: the re-dispatched copy starts later, ends earlier
            out[i] = True
        else:
            key, open_start, open_end = k, trace.start[i], trace.end[i]
    return out


@dataclass
class Analysis:
    """Breakdowns of every rank and step, plus the cross-rank view."""

    steps: list[StepBreakdown]
    clock: str

    def ranks(self) -> list[int]:
        return sorted({b.rank for b in self.steps})

    def step_numbers(self) -> list[int]:
        return sorted({b.step for b in self.steps})

    def get(self, rank: int, step: int) -> StepBreakdown:
        for b in self.steps:
            if b.rank == rank and b.step == step:
                return b
        raise KeyError(
            f"no step {step} for rank {rank}; steps: {self.step_numbers()}, ranks: {self.ranks()}"
        )

    def per_rank(self) -> list[dict]:
        """Mean over steps, one row per rank (milliseconds; overlap as a fraction)."""
        rows = []
        for r in self.ranks():
            mine = [b.row() for b in self.steps if b.rank == r]
            row = {
                k: float(np.mean([m[k] for m in mine]))
                for k in mine[0]
                if k not in ("rank", "step")
            }
            rows.append({"rank": r, **row})
        return rows

    def stragglers(self) -> list[dict]:
        """Per step: the slowest rank and how long each other rank waited for it (ms).

        The slowest rank of one step is a fact about that step (key ``"straggler"``); whether one
        rank is slow across the run is :meth:`straggler`'s verdict.
        """
        out = []
        for s in self.step_numbers():
            here = {b.rank: b for b in self.steps if b.step == s}
            slow = max(here, key=lambda r: here[r].busy)
            out.append(
                {
                    "step": s,
                    "straggler": slow,
                    "waited_ms": {
                        r: here[slow].busy - b.busy for r, b in here.items() if r != slow
                    },
                }
            )
        return out

    def straggler(self, margin: float = 0.25) -> int | None:
        """The rank that is clearly slowest across the run, or ``None``.

        Clearly: in *every* recorded step the same rank has the most non-communication work
        (compute + data + optimizer), more than ``1 + margin`` times (25% more than) every other
        rank's. One slow step, or a lead that changes hands, is noise, not a straggler. The table,
        the timeline, the bars and the step picker all name a straggler by this rule.
        """
        if len(self.ranks()) < 2:
            return None
        verdicts = set()
        for s in self.step_numbers():
            busy = {b.rank: b.busy for b in self.steps if b.step == s}
            slow = max(busy, key=busy.get)
            others = max(b for r, b in busy.items() if r != slow)
            verdicts.add(slow if busy[slow] > (1 + margin) * others else None)
        return verdicts.pop() if len(verdicts) == 1 else None

    def table(self) -> str:
        """The per-rank means as a text table: the step time, one column per class, communication.

        Every column but ``rank`` and ``comm hidden %`` is milliseconds per step.
        """
        cols = [
            ("rank", 4),
            ("step time", 9),
            ("compute", 8),
            ("memory", 7),
            ("comm exposed", 12),
            ("data", 7),
            ("optimizer", 9),
            ("idle", 7),
            ("comm total", 10),
            ("comm hidden %", 13),
        ]
        head = " | ".join(f"{name:>{w}}" for name, w in cols)
        lines = [head, "-" * len(head)]
        slow = self.straggler()
        for r in self.per_rank():
            values = [
                f"{r['rank']:>4}",
                f"{r['step_ms']:9.2f}",
                f"{r['compute']:8.2f}",
                f"{r['memory']:7.2f}",
                f"{r['communication']:12.2f}",
                f"{r['data']:7.2f}",
                f"{r['optimizer']:9.2f}",
                f"{r['idle']:7.2f}",
                f"{r['comm_total']:10.2f}",
                f"{r['overlap']:13.0%}",
            ]
            lines.append(" | ".join(values) + ("   <- straggler" if r["rank"] == slow else ""))
        lines.append(
            "Milliseconds per step, mean over the recorded steps, except comm hidden %. "
            "compute + memory + comm exposed + data + optimizer + idle = step time (memory: a GPU's copies and fills). comm exposed: "
            "communication while the rank did nothing else; comm total: all of it, including what "
            "overlapped compute; comm hidden %: the share of comm total that overlapped."
        )
        return "\n".join(lines)


def analyse(traces: dict[int, Trace], parallel: bool | None = None) -> Analysis:
    """Align the ranks' clocks and break every step of every rank down (in parallel when large)."""

    clock = align(traces)
    events = sum(len(t.start) for t in traces.values())
    if parallel is None:
        parallel = len(traces) > 1 and events > 1_000_000 and (os.cpu_count() or 1) > 1
    if parallel:  # each trace's analysis is independent: one process per core
        from concurrent.futures import ProcessPoolExecutor

        from ..launcher.procs import get_context

        with ProcessPoolExecutor(
            min(len(traces), os.cpu_count() or 1), mp_context=get_context("auto")
        ) as pool:
            per_rank = list(pool.map(analyse_trace, traces.values()))
    else:
        per_rank = [analyse_trace(t) for t in traces.values()]
    return Analysis(steps=[b for bs in per_rank for b in bs], clock=clock)
