"""Reading Kineto / Chrome traces (``torch.profiler`` output) into compact columns.

    from course_utils.profiling.trace import load_traces
    traces = load_traces(res.run_dir / "traces")      # {rank: Trace}

Only complete events (``"ph": "X"``) of the kinds the analysis uses are kept:
CPU ops and annotations on CPU threads, GPU kernels and memory copies on
streams. Each trace becomes numpy columns (start, end, lane, name id), so
eight ranks of 50 MB parse in a few seconds and fit in memory.
"""

from __future__ import annotations

import gzip
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

STEP = re.compile(r"^ProfilerStep#(\d+)$")
MARKER = "course_utils::clock_marker"
CPU_CATS = {"cpu_op", "user_annotation"}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


class TraceError(ValueError):
    """A trace file that cannot be used, with the file and the problem named."""


@dataclass
class Trace:
    """One rank's trace as columns. Times are microseconds on the trace's clock (+ ``offset``)."""

    path: Path
    rank: int
    rank_source: str
    """``"distributedInfo"`` (written by torch.distributed) or ``"file name"`` (fallback)."""
    world_size: int | None
    host: str | None
    names: list[str]
    """Unique event names; ``name_id`` indexes into it."""
    name_is_annotation: np.ndarray
    """Per name: a ``user_annotation`` (a label such as ``DistributedDataParallel.forward``), not an op."""
    lanes: list[str]
    """One per CPU thread or GPU stream: ``"thread 123 (python)"``, ``"GPU 0 stream 7"``."""
    lane_is_gpu: np.ndarray
    main_lane: int
    """The thread that ran the training loop (holds the ``ProfilerStep#N`` events)."""
    name_id: np.ndarray
    lane: np.ndarray
    start: np.ndarray
    end: np.ndarray
    steps: list[tuple[int, float, float]]
    """``(step number, start, end)`` of each recorded step, from ``ProfilerStep#N``."""
    markers: list[float] = field(default_factory=list)
    """End times of ``course_utils::clock_marker`` events (recorded right after a barrier)."""
    offset: float = 0.0
    """Shift (µs) added by :func:`align` to put this rank on a common clock."""

    @property
    def has_gpu(self) -> bool:
        return bool(self.lane_is_gpu.any())

    def __repr__(self) -> str:
        kind = "GPU+CPU" if self.has_gpu else "CPU-only"
        return (
            f"Trace(rank={self.rank} from {self.rank_source}, {kind}, {len(self.start)} events, "
            f"{len(self.steps)} steps, {self.path.name})"
        )


class _Event(msgspec.Struct):
    """The fields of a trace event the analysis reads; everything else is skipped while decoding."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    args: msgspec.Raw = msgspec.Raw(b"null")  # decoded only for metadata events


class _Doc(msgspec.Struct):
    traceEvents: list[_Event]
    distributedInfo: dict | None = None
    host_name: str | None = None


def _read(path: Path) -> _Doc:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise TraceError(
            f"{path}: cannot read it ({type(e).__name__}: {e}); a truncated .gz usually means "
            "the rank was killed while writing it."
        ) from None
    try:
        return msgspec.json.decode(raw, type=_Doc)
    except msgspec.ValidationError as e:
        raise TraceError(
            f"{path}: no 'traceEvents' list of events ({e}); is this a torch.profiler "
            "(Kineto/Chrome) trace?"
        ) from None
    except msgspec.DecodeError as e:
        raise TraceError(
            f"{path}: not a readable JSON trace ({e}). A truncated file usually means the rank was killed "
            "while writing it."
        ) from None


def _rank_of(path: Path, data: _Doc) -> tuple[int, str]:
    info = data.distributedInfo or {}
    if isinstance(info.get("rank"), int):
        return info["rank"], "distributedInfo"
    m = re.search(r"rank[_-]?(\d+)", path.name)
    if m:
        return int(m.group(1)), "file name"
    raise TraceError(
        f"{path}: cannot tell which rank wrote it: no distributedInfo.rank in the trace and no "
        "'rank<N>' in the file name"
    )


@dataclass
class _Columns:
    """The kept events of one trace, as lists in file order, with the lookup tables built on the
    way: ``names`` and ``lanes`` map a name and a ``(kind, pid, tid)`` lane to its index."""

    thread_names: dict[tuple, str]
    names: dict[str, int]
    lanes: dict[tuple, int]
    lane_gpu: list[bool]
    annotation: list[bool]
    name_id: list[int]
    lane: list[int]
    start: list[float]
    dur: list[float]


def _remember_thread_name(e: _Event, thread_names: dict[tuple, str]) -> None:
    """Record a ``thread_name`` metadata event's label; a later "(python)" label does not
    replace an earlier one (keeps "pt_gloo_runloop")."""
    name = (msgspec.json.decode(e.args) or {}).get("name", "")
    key = (e.pid, e.tid)
    if key not in thread_names or not name.endswith("(python)"):
        thread_names[key] = name


def _collect_events(path: Path, events: list[_Event]) -> _Columns:
    """Keep the CPU and GPU complete events as columns and the thread names; raise
    :class:`TraceError` when no event is kept."""
    thread_names: dict[tuple, str] = {}
    names: dict[str, int] = {}
    lanes: dict[tuple, int] = {}
    lane_gpu: list[bool] = []
    annotation: list[bool] = []
    name_id, lane, start, dur = [], [], [], []
    for e in events:
        if e.ph != "X":
            if e.ph == "M" and e.name == "thread_name":
                _remember_thread_name(e, thread_names)
            continue
        gpu = e.cat in GPU_CATS
        if not gpu and e.cat not in CPU_CATS:
            continue
        key = ("gpu" if gpu else "cpu", e.pid, e.tid)
        li = lanes.get(key)
        if li is None:
            li = lanes[key] = len(lanes)
            lane_gpu.append(gpu)
        ni = names.get(e.name)
        if ni is None:
            ni = names[e.name] = len(names)
            annotation.append(e.cat == "user_annotation")
        name_id.append(ni)
        lane.append(li)
        start.append(e.ts)
        dur.append(e.dur)
    if not start:
        raise TraceError(
            f"{path}: the trace has no CPU or GPU events: was anything run inside the "
            "profiled steps (ctx.step() called at the end of each step)?"
        )
    return _Columns(thread_names, names, lanes, lane_gpu, annotation, name_id, lane, start, dur)


def _lane_labels(lanes: dict[tuple, int], thread_names: dict[tuple, str]) -> list[str]:
    """One label per lane, in lane order: the thread's name, or ``"GPU <pid> stream <tid>"``."""
    labels = []
    for (kind, pid, tid), _ in sorted(lanes.items(), key=lambda kv: kv[1]):
        labels.append(
            f"GPU {pid} stream {tid}"
            if kind == "gpu"
            else thread_names.get((pid, tid), f"thread {tid}")
        )
    return labels


def _steps_and_main_lane(
    names: dict[str, int],
    name_id: np.ndarray,
    lane: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    lane_gpu: list[bool],
) -> tuple[list[tuple[int, float, float]], int]:
    """The ``ProfilerStep#N`` windows, sorted, and the lane that holds most of them; without
    them, the whole trace as step -1 on the busiest CPU thread."""
    step_ids = {i: int(STEP.match(n).group(1)) for n, i in names.items() if STEP.match(n)}
    if not step_ids:
        cpu = ~np.asarray(lane_gpu)[lane]
        main_lane = int(np.bincount(lane[cpu]).argmax()) if cpu.any() else 0
        return [(-1, float(start.min()), float(end.max()))], main_lane
    is_step = np.isin(name_id, list(step_ids))
    main_lane = int(np.bincount(lane[is_step]).argmax())
    steps = []
    for idx in np.flatnonzero(is_step):
        steps.append((step_ids[int(name_id[idx])], float(start[idx]), float(end[idx])))
    steps.sort()
    return steps, main_lane


def load_trace(path: str | os.PathLike) -> Trace:
    """Parse one trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    data = _read(path)
    rank, source = _rank_of(path, data)
    cols = _collect_events(path, data.traceEvents)
    name_id_a = np.asarray(cols.name_id, dtype=np.int32)
    lane_a = np.asarray(cols.lane, dtype=np.int32)
    start_a = np.asarray(cols.start, dtype=np.float64)
    end_a = start_a + np.asarray(cols.dur, dtype=np.float64)
    steps, main_lane = _steps_and_main_lane(
        cols.names, name_id_a, lane_a, start_a, end_a, cols.lane_gpu
    )
    markers = []
    if MARKER in cols.names:
        markers = sorted(end_a[name_id_a == cols.names[MARKER]].tolist())
    info = data.distributedInfo or {}
    return Trace(
        path=path,
        rank=rank,
        rank_source=source,
        world_size=info.get("world_size"),
        host=data.host_name,
        names=list(cols.names),
        name_is_annotation=np.asarray(cols.annotation, dtype=bool),
        lanes=_lane_labels(cols.lanes, cols.thread_names),
        lane_is_gpu=np.asarray(cols.lane_gpu, dtype=bool),
        main_lane=main_lane,
        name_id=name_id_a,
        lane=lane_a,
        start=start_a,
        end=end_a,
        steps=steps,
        markers=markers,
    )


def find_trace_files(where) -> list[Path]:
    """Trace files in a folder (``*.json`` / ``*.json.gz``), or the given list of paths."""
    if isinstance(where, (str, os.PathLike)):
        folder = Path(where)
        if folder.is_file():
            return [folder]
        if not folder.is_dir():
            raise TraceError(f"{folder}: no such folder or file")
        files = sorted(p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz")))
        if not files:
            raise TraceError(f"{folder}: no trace files (*.json, *.json.gz) in this folder")
        return files
    return [Path(p) for p in where]


def load_traces(where, parallel: bool | None = None) -> dict[int, Trace]:
    """Parse every trace in a folder (or a list of files, or ``res.traces``); return ``{rank: Trace}``.

    Large inputs are parsed in parallel worker processes (forked from the
    launcher's torch-free-of-threads forkserver); ``parallel`` forces it on or off.
    """
    if isinstance(where, dict):
        where = list(where.values())
    files = find_trace_files(where)
    total = sum(f.stat().st_size for f in files)
    if parallel is None:
        parallel = len(files) > 1 and total > 32 * 2**20 and (os.cpu_count() or 1) > 1
    if parallel:
        from concurrent.futures import ProcessPoolExecutor

        from ..launcher.procs import get_context

        workers = min(len(files), os.cpu_count() or 1)
        with ProcessPoolExecutor(workers, mp_context=get_context("auto")) as pool:
            parsed = list(pool.map(load_trace, files))
    else:
        parsed = [load_trace(f) for f in files]
    traces: dict[int, Trace] = {}
    for t in parsed:
        if t.rank in traces:
            raise TraceError(
                f"rank {t.rank} appears twice: {traces[t.rank].path} and {t.path}. Keep one "
                "trace per rank in the folder (one run, one profiling window)."
            )
        traces[t.rank] = t
    return dict(sorted(traces.items()))


def align(traces: dict[int, Trace]) -> str:
    """Put all ranks on one clock; return how.

    Ranks on one host share a clock: nothing to do. Across hosts, each rank is
    shifted so that its first clock marker (recorded right after a barrier)
    coincides with rank 0's.
    """
    hosts = {t.host for t in traces.values()}
    if len(hosts) <= 1:
        for t in traces.values():
            t.offset = 0.0
        return "shared clock (one host)"
    ref = min(traces)
    if any(not t.markers for t in traces.values()):
        missing = sorted(r for r, t in traces.items() if not t.markers)
        raise TraceError(
            f"ranks {missing} run on different hosts but have no clock marker; record with "
            "ProfileConfig(align_clocks=True) to compare their timelines"
        )
    for t in traces.values():
        t.offset = traces[ref].markers[0] - t.markers[0]
    return "clock markers (several hosts)"


def marker_skew_us(traces: dict[int, Trace]) -> float:
    """Spread (µs) of the first clock marker across ranks, after alignment offsets."""
    ends = [t.markers[0] + t.offset for t in traces.values() if t.markers]
    if len(ends) < 2:
        raise TraceError("clock markers are missing: record with ProfileConfig(align_clocks=True)")
    return max(ends) - min(ends)
