"""Checks for notebook 04 (profiling): exposed communication from raw events, bus bandwidth."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from ..bench.collectives import OPS, bus_factor
from ..comm import ring_factor
from ..profiling.analysis import analyse, analyse_trace, classify_name, union
from ..profiling.trace import load_trace
from .common import fail, passed, refuse_calls


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def _step(k, t0, length):
    return _x(f"ProfilerStep#{k}", t0, length, cat="user_annotation")


# Hand-made CPU/gloo steps (µs), each with a different overlap pattern.
CASES = {
    "communication partly hidden behind compute": [
        _step(3, 0, 100_000),
        _x("data", 0, 10_000, cat="user_annotation"),
        _x("aten::mm", 10_000, 45_000),
        _x("c10d::allreduce_", 50_000, 5_000),
        _x("gloo:all_reduce", 40_000, 30_000, tid=2, cat="user_annotation"),
        _x("Optimizer.step#SGD.step", 80_000, 10_000, cat="user_annotation"),
    ],
    "one step hidden, the next exposed": [
        _step(1, 0, 50_000),
        _x("aten::conv2d", 0, 40_000),
        _x("gloo:all_reduce", 10_000, 20_000, tid=2, cat="user_annotation"),
        _step(2, 50_000, 50_000),
        _x("aten::conv2d", 50_000, 10_000),
        _x("c10d::allreduce_", 60_000, 30_000),
        _x("gloo:all_reduce", 60_000, 30_000, tid=2, cat="user_annotation"),
    ],
    "a DDP label around a wait": [
        _step(5, 0, 60_000),
        _x("DistributedDataParallel.forward", 0, 60_000, cat="user_annotation"),
        _x("aten::linear", 0, 20_000),
        _x("c10d::allreduce_", 20_000, 25_000),
        _x("gloo:all_reduce", 15_000, 30_000, tid=2, cat="user_annotation"),
        _x("aten::relu", 45_000, 5_000),
        # the main thread runs no op from 50 to 58 ms: only the label covers it
        _x("gloo:all_reduce", 50_000, 8_000, tid=2, cat="user_annotation"),
    ],
    "communication during data loading and the optimizer": [
        _step(7, 0, 80_000),
        _x(
            "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
            0,
            20_000,
            cat="user_annotation",
        ),
        _x("gloo:broadcast", 5_000, 30_000, tid=2, cat="user_annotation"),
        _x("aten::addmm", 20_000, 20_000),
        _x("Optimizer.step#Adam.step", 50_000, 20_000, cat="user_annotation"),
        _x("gloo:all_reduce", 45_000, 30_000, tid=2, cat="user_annotation"),
    ],
    "communication past the step's end, data loaded on another thread": [
        _step(9, 0, 50_000),
        _x("aten::mm", 0, 20_000),
        _x(
            "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
            20_000,
            15_000,
            tid=3,
            cat="user_annotation",
        ),  # fmt: skip
        _x("gloo:all_reduce", 25_000, 45_000, tid=2, cat="user_annotation"),  # ends at 70 ms
        _step(10, 50_000, 40_000),
        _x("aten::mm", 50_000, 10_000),
    ],
}


def _write(path: Path, events) -> Path:
    names = [
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 1,
            "tid": 1,
            "args": {"name": "thread 1 (python)"},
        },
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "pt_gloo_runloop"}},
    ]
    data = {"schemaVersion": 1, "traceEvents": names + events, "distributedInfo": {"rank": 0}}
    path.write_text(json.dumps(data))
    return path


def _comm_total_ms(trace, k) -> float:

    _, s0, s1 = trace.steps[k]
    comm = np.array([classify_name(n) == "communication" for n in trace.names])[trace.name_id]
    m = comm & (trace.end > s0) & (trace.start < s1)
    s, e = union(np.clip(trace.start[m], s0, s1), np.clip(trace.end[m], s0, s1))
    return float((e - s).sum()) / 1e3


WHOLE_BREAKDOWN = (
    "your function asked the course's breakdown (analyse / analyse_trace), which the check "
    "compares with; build the exposed time yourself from the trace's events, union and subtract"
)


def check_exposed_communication(exposed_communication_ms, traces=None) -> None:
    """Exercise 04.1: ``exposed_communication_ms(trace, k)`` for recorded step ``k`` of a CPU trace."""
    with tempfile.TemporaryDirectory() as tmp:
        loaded = [
            (label, load_trace(_write(Path(tmp) / f"rank0.case{i}.json", events)))
            for i, (label, events) in enumerate(CASES.items())
        ]
    for rank, t in sorted((traces or {}).items()):
        if not t.has_gpu:  # the notebook's own CPU ranks (the definition is the CPU one)
            loaded.append((f"rank {rank} of the notebook's first run", t))
    checked = 0
    for label, trace in loaded:
        for k, breakdown in enumerate(analyse_trace(trace)):
            want = breakdown.communication
            with (
                refuse_calls("04.1", [analyse_trace, analyse], WHOLE_BREAKDOWN),
            ):
                got = float(exposed_communication_ms(trace, k))
            checked += 1
            if abs(got - want) <= 1e-6 * max(1.0, want):
                continue
            step = trace.steps[k][0]
            if want > 0 and abs(got - 1000 * want) <= 1e-6 * got:
                hint = "1000 times the right value: the trace's times are in µs; return ms"
            elif abs(got - _comm_total_ms(trace, k)) <= 1e-6 * max(1.0, got):
                hint = (
                    "all of the communication: the part that ran while the training thread "
                    "computed, loaded data or ran the optimizer is hidden, not exposed"
                )
            elif got > want:
                hint = (
                    "too much: count each moment once (merge overlapping events), count only "
                    "inside the step (clip every interval to its start and end), and let data "
                    "loading and the optimizer, on any thread, hide communication as compute does"
                )
            else:
                hint = (
                    "too little: time the training thread spends in a collective (a c10d:: call, "
                    "or waiting for gloo's thread, whose gloo: events hold the wait) is not "
                    "computing (take that time out of compute), and a user_annotation such as "
                    "DistributedDataParallel.forward labels a span, it is not work"
                )
            fail("04.1", f"{label}, step {step}: your exposed communication is {hint}.")
    passed("04.1", f"exposed communication equals the breakdown's in {checked} recorded steps")


LOOKED_UP = (
    "your function asked collectives.bus_factor (or comm.ring_factor, which it uses), which the "
    "check compares with; work out each "
    "collective's factor yourself: how much of the buffer must each rank send or receive at least?"
)


def check_bus_bandwidth(bus_bandwidth) -> None:
    """Exercise 04.2: ``bus_bandwidth(op, nbytes, seconds, n)`` in GB/s, as nccl-tests defines it."""
    checked = 0
    for op in OPS:
        for n in (2, 3, 4, 8):
            for nbytes, seconds in ((1 << 20, 1e-3), (3 << 28, 0.25)):
                want = nbytes / seconds / 1e9 * bus_factor(op, n)
                with refuse_calls("04.2", [bus_factor, ring_factor], LOOKED_UP):
                    got = bus_bandwidth(op, nbytes, seconds, n)
                checked += 1
                if abs(got - want) <= 1e-9 * want:
                    continue
                algbw = nbytes / seconds / 1e9
                if abs(got - algbw) <= 1e-9 * algbw and op != "broadcast":
                    hint = "that is the algorithm bandwidth; the bus bandwidth multiplies it by a factor"
                elif abs(got - nbytes / seconds) <= 1e-6 * nbytes / seconds:
                    hint = "give it in GB/s (1e9 bytes per second)"
                elif abs(got - want * 1e9 / 2**30) <= 1e-9 * want:
                    hint = "GB/s, as nccl-tests prints it, is 1e9 bytes per second, not 2**30"
                else:
                    hint = (
                        "the factor is how much of the buffer each rank must send or receive at "
                        "least, on n ranks"
                    )
                fail("04.2", f"{op} on {n} ranks: your bus bandwidth is off: {hint}.")
    passed("04.2", f"bus bandwidth right for {len(OPS)} collectives on 2, 3, 4 and 8 ranks")
