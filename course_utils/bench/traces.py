"""``python -m course_utils bench traces``: parse + analyse 8 rank traces of ~50 MB each.

The traces are generated in the Kineto schema a CPU/gloo DDP run produces:
``ProfilerStep#N`` windows on the training thread, nested ``cpu_op`` events
with input shapes, a data-loading and an optimizer annotation per step, and
``gloo:all_reduce`` events on a gloo thread. Generation is not timed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from . import provenance

OPS = [
    "aten::mm",
    "aten::addmm",
    "aten::add_",
    "aten::copy_",
    "aten::relu",
    "aten::mul",
    "aten::sum",
    "aten::convolution",
    "aten::native_batch_norm",
    "aten::threshold_backward",
]


def _thread_names(pid: int, main: int, gloo: int) -> list[dict]:
    """The metadata events that name the training thread and the gloo thread."""
    return [
        {
            "ph": "M",
            "name": "thread_name",
            "pid": pid,
            "tid": tid,
            "args": {"name": f"thread {tid} ({label})"},
        }
        for tid, label in ((main, "python"), (gloo, "pt_gloo_runloop"))
    ]


def _annotation(name: str, pid: int, tid: int, ts: float, dur: float, args=None) -> dict:
    """A ``user_annotation`` event (a ``record_function`` range or a gloo collective)."""
    event = {
        "ph": "X",
        "cat": "user_annotation",
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": dur,
    }
    if args is not None:
        event["args"] = args
    return event


def _cpu_op(name: str, pid: int, tid: int, ts: float, dur: float, eid: int) -> dict:
    """An ``aten::`` operator event with the input shapes a profiled ``mm`` records."""
    return {
        "ph": "X",
        "cat": "cpu_op",
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": round(ts, 3),
        "dur": round(dur, 3),
        "args": {
            "External id": eid,
            "Record function id": 0,
            "Ev Idx": eid,
            "Input Dims": [[64, 256], [256, 256]],
            "Input type": ["float", "float"],
        },
    }


def _step_events(
    rng: random.Random, pid: int, main: int, gloo: int, step: int, ts: float, eid: int
) -> tuple[list[dict], float, int]:
    """One ``ProfilerStep#step`` starting at ``ts``: data loading, 2000 operators with an
    all-reduce on the gloo thread after about 2% of them, the optimizer step.

    Returns the events, the time after the step and the last external id used."""
    step_start = ts
    ops = [_annotation("data", pid, main, ts, 500.0)]
    ts += 500.0
    for _ in range(2000):
        dur = rng.uniform(2, 40)
        eid += 1
        ops.append(_cpu_op(rng.choice(OPS), pid, main, ts, dur, eid))
        if rng.random() < 0.02:
            comm_dur = round(rng.uniform(50, 400), 3)
            comm = _annotation(
                "gloo:all_reduce", pid, gloo, round(ts, 3), comm_dur, {"External id": eid}
            )
            ops.append(comm)
        ts += dur + 1.0
    ops.append(_annotation("Optimizer.step#SGD.step", pid, main, round(ts, 3), 300.0))
    ts += 400.0
    ops.append(
        _annotation(f"ProfilerStep#{step}", pid, main, step_start, round(ts - step_start, 3))
    )
    return ops, ts, eid


def write_trace(path: Path, rank: int, world_size: int, target_mb: float, seed: int = 0) -> int:
    """Write one synthetic rank trace of about ``target_mb`` MB; return its size in bytes."""
    rng = random.Random(seed * 1000 + rank)
    pid, main, gloo = 1000 + rank, 1000 + rank, 2000 + rank
    events = _thread_names(pid, main, gloo)
    ts, step, size, eid = 0.0, 0, 0, 0
    while size < target_mb * 1e6:
        ops, ts, eid = _step_events(rng, pid, main, gloo, step, ts, eid)
        events += ops
        # the size is estimated from the step's first 20 events, not by serialising them all
        size += sum(len(json.dumps(e)) for e in ops[:20]) * len(ops) / 20
        step += 1
    data = {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world_size},
        "host_name": "bench",
        "traceEvents": events,
    }
    path.write_text(json.dumps(data))
    return path.stat().st_size


def run(ranks: int = 8, target_mb: float = 50.0, keep: str | None = None) -> dict:
    """Generate the traces, then time load_traces + analyse in a fresh child process."""
    import subprocess
    import sys

    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="bench-traces-"))
    folder.mkdir(parents=True, exist_ok=True)
    sizes = [
        write_trace(folder / f"rank{r}.pt.trace.json", r, ranks, target_mb) for r in range(ranks)
    ]
    code = (
        "import json, resource, sys, time\n"
        "t0 = time.perf_counter()\n"
        "from course_utils.profiling.trace import load_traces\n"
        "from course_utils.profiling.analysis import analyse\n"
        "t1 = time.perf_counter()\n"
        "traces = load_traces(sys.argv[1])\n"
        "t2 = time.perf_counter()\n"
        "a = analyse(traces)\n"
        "t3 = time.perf_counter()\n"
        "peak = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
        "print(json.dumps({'import_s': t1 - t0, 'parse_s': t2 - t1, 'analyse_s': t3 - t2, 'events': sum(len(t.start) for t in traces.values()),"
        " 'steps': len(a.steps), 'peak_rss_mb': peak / 1024}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Peaks are read from VmHWM: ru_maxrss survives exec on Linux and would report this parent's peak.
    # The parse workers are forked by the launcher's forkserver, outside this process tree: measure
    # one worker's peak by parsing one trace in a process of its own.
    one = (
        "import sys\n"
        "def hwm(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) / 1024\n"
        "from course_utils.profiling.trace import load_trace\n"
        "from course_utils.profiling.analysis import analyse_trace\n"
        "print(hwm())\n"
        "analyse_trace(load_trace(sys.argv[1]))\n"
        "print(hwm())\n"
    )
    first = folder / "rank0.pt.trace.json"
    out = subprocess.run(
        [sys.executable, "-c", one, str(first)], capture_output=True, text=True, check=True
    )
    baseline, peak = (float(v) for v in out.stdout.strip().splitlines()[-2:])
    result["import_rss_mb"], result["worker_peak_rss_mb"] = baseline, peak
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
    result.update(
        ranks=ranks,
        mb_each=sum(sizes) / len(sizes) / 1e6,
        total_mb=sum(sizes) / 1e6,
        **provenance(),
    )
    result["total_s"] = result["parse_s"] + result["analyse_s"]
    return result


def table(r: dict) -> str:
    return "\n".join(
        [
            f"{r['ranks']} traces x {r['mb_each']:.1f} MB ({r['total_mb']:.0f} MB, {r['events']:,} events, "
            f"{r['steps']} rank-steps), {r['machine']}, {r['date']}",
            "| phase | seconds |",
            "| --- | ---: |",
            f"| parse (load_traces, parallel) | {r['parse_s']:.2f} |",
            f"| analyse (classify + partition every step) | {r['analyse_s']:.2f} |",
            f"| **parse + analyse** (target <= 10 s) | **{r['total_s']:.2f}** |",
            f"| peak RSS, analysing process (holds every rank's columns) | {r['peak_rss_mb']:.0f} MB |",
            f"| peak RSS, one parse worker (torch imported; up to {os.cpu_count()} at once) "
            f"| {r['worker_peak_rss_mb']:.0f} MB |",
            f"| of which importing torch + course_utils alone | {r['import_rss_mb']:.0f} MB |",
        ]
    )
