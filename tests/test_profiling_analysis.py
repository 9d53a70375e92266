"""Trace parsing and analysis: exact numbers on hand-made events, the committed fixtures, bad input."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import matplotlib
import pytest

from course_utils.profiling.analysis import analyse, analyse_trace, classify_name, union
from course_utils.profiling.trace import TraceError, align, load_trace, load_traces, marker_skew_us

matplotlib.use("Agg")
FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def x(name, ts, dur, tid=1, cat="cpu_op", pid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def write(path, events, rank=0, host="node", dist_info=True, mkdir=False):
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "schemaVersion": 1,
        "host_name": host,
        "traceEvents": [
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 1,
                "tid": 1,
                "args": {"name": "thread 1 (python)"},
            },
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 1,
                "tid": 2,
                "args": {"name": "thread 2 (pt_gloo_runloop)"},
            },
            *events,
        ],
    }
    if dist_info:
        data["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": 2}
    path.write_text(json.dumps(data))
    return path


CPU_EVENTS = [  # µs; step 3 is [0, 100000] -> 100 ms
    x("ProfilerStep#3", 0, 100_000, cat="user_annotation"),
    x("data", 0, 10_000, cat="user_annotation"),
    x("aten::mm", 10_000, 45_000),  # compute, partly inside the c10d call below
    x("c10d::allreduce_", 50_000, 5_000),  # training thread blocked in a collective
    x(
        "gloo:all_reduce", 40_000, 30_000, tid=2, cat="user_annotation"
    ),  # the gloo thread moves data
    x("Optimizer.step#SGD.step", 80_000, 10_000, cat="user_annotation"),
]


def test_cpu_breakdown_exact(tmp_path):
    a = analyse({0: load_trace(write(tmp_path / "rank0.json", CPU_EVENTS))})
    (b,) = a.steps
    assert b.step == 3 and b.step_ms == 100
    assert b.data == 10 and b.optimizer == 10
    assert b.compute == 40  # [10, 55] minus the 5 ms the thread spent inside c10d::allreduce_
    assert b.comm_total == 30 and b.communication == 20  # [40, 70]; [40, 50] hidden behind compute
    assert b.overlap == pytest.approx(1 / 3)
    assert b.idle == 20  # [70, 80] and [90, 100]
    assert b.compute + b.memory + b.communication + b.data + b.optimizer + b.idle == b.step_ms


def test_gpu_fixture_breakdown_exact_and_straggler():
    traces = load_traces(FIXTURES / "gpu_minimal")
    assert traces[0].has_gpu and traces[0].rank_source == "distributedInfo"
    a = analyse(traces)
    b0, b1 = a.get(0, 5), a.get(1, 5)
    assert (b0.step_ms, b0.compute, b0.communication, b0.comm_total) == pytest.approx(
        (10, 4.4, 2.0, 3.0)
    )
    # the host-to-device copy (0.1 ms) is memory, not compute, as Holistic Trace Analysis counts it
    assert (b0.memory, b0.data, b0.optimizer, b0.idle) == pytest.approx((0.1, 0.9, 0.6, 2.0))
    assert (b1.compute, b1.memory, b1.communication) == pytest.approx((5.4, 0.1, 1.0))
    assert a.stragglers()[0]["straggler"] == 1  # the slowest rank of this step
    assert a.stragglers()[0]["waited_ms"][0] == pytest.approx(1.0)
    assert a.straggler() is None  # 1 ms more of 6 ms is within the default 25% margin
    assert a.straggler(margin=0.1) == 1


def test_committed_cpu_gloo_fixture():
    traces = load_traces(FIXTURES / "cpu_gloo")
    assert sorted(traces) == [0, 1] and not traces[0].has_gpu
    assert any("pt_gloo_runloop" in lane for lane in traces[0].lanes)
    a = analyse(traces)
    assert a.clock.startswith("shared clock")
    for b in a.steps:
        assert b.comm_total > 0, "gloo collectives must be found on every rank"
        parts = b.compute + b.memory + b.communication + b.data + b.optimizer + b.idle
        assert parts == pytest.approx(b.step_ms, abs=1e-6)
    assert "overlap" in a.table()


def test_classify_names():
    assert classify_name("gloo:all_reduce") == "communication"
    assert classify_name("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert classify_name("c10d::broadcast_") == "communication"
    assert classify_name("aten::broadcast_tensors") == "compute"
    assert classify_name("DistributedDataParallel.forward") == "compute"
    assert classify_name("Memcpy HtoD (Pinned -> Device)") == "memory"
    assert classify_name("Memset (Device)") == "memory"
    assert classify_name("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__") == "data"
    assert classify_name("Optimizer.zero_grad#SGD.zero_grad") == "optimizer"
    assert classify_name("ProfilerStep#7") is None


def test_union_merges_overlaps():
    import numpy as np

    s, e = union(np.array([5.0, 0.0, 2.0, 10.0]), np.array([6.0, 3.0, 4.0, 11.0]))
    assert s.tolist() == [0.0, 5.0, 10.0] and e.tolist() == [4.0, 6.0, 11.0]


def test_rank_from_file_name_and_gz(tmp_path):
    path = write(tmp_path / "worker_rank3.json", CPU_EVENTS, dist_info=False)
    gz = tmp_path / "worker_rank3.json.gz"
    with open(path, "rb") as f, gzip.open(gz, "wb") as g:
        shutil.copyfileobj(f, g)
    t = load_trace(gz)
    assert t.rank == 3 and t.rank_source == "file name"


def test_rank_comes_from_distributed_info_when_the_file_name_disagrees(tmp_path):
    """Files renamed or swapped by hand: the rank stored inside the trace wins over the name."""
    slow = [e if e["name"] != "aten::mm" else {**e, "dur": e["dur"] + 5_000} for e in CPU_EVENTS]
    write(tmp_path / "rank0.json", slow, rank=1)  # rank 1's trace under rank 0's name
    write(tmp_path / "rank1.json", CPU_EVENTS, rank=0)
    traces = load_traces(tmp_path)
    assert sorted(traces) == [0, 1]
    assert traces[1].path.name == "rank0.json" and traces[0].path.name == "rank1.json"
    assert {t.rank_source for t in traces.values()} == {"distributedInfo"}
    a = analyse(traces)
    assert a.get(1, 3).compute > a.get(0, 3).compute  # the slow events belong to rank 1


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"traceEvents": [{"ph": "X", "ts": 1', "truncated"),
        (b"not json at all", "not a readable JSON trace"),
        (b'{"schemaVersion": 1}', "no 'traceEvents' list"),
        (b'{"traceEvents": [], "distributedInfo": {"rank": 0}}', "has no CPU or GPU events"),
    ],
)
def test_bad_trace_files_are_named(tmp_path, content, words):
    path = tmp_path / "rank0.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_bad_folders(tmp_path):
    with pytest.raises(TraceError, match="no trace files"):
        load_traces(tmp_path)
    with pytest.raises(TraceError, match="no such folder"):
        load_traces(tmp_path / "missing")
    write(tmp_path / "a.json", CPU_EVENTS, rank=1)
    write(tmp_path / "b.json", CPU_EVENTS, rank=1)
    with pytest.raises(TraceError, match="rank 1 appears twice"):
        load_traces(tmp_path)
    (tmp_path / "anon.json").write_text(json.dumps({"traceEvents": [x("a", 0, 1)]}))
    with pytest.raises(TraceError, match="cannot tell which rank"):
        load_trace(tmp_path / "anon.json")


def test_align_on_markers_across_hosts(tmp_path):
    marker = "course_utils::clock_marker"
    r0 = load_trace(
        write(tmp_path / "r0.json", [*CPU_EVENTS, x(marker, 20_000, 0)], rank=0, host="a")
    )
    r1 = load_trace(
        write(tmp_path / "r1.json", [*CPU_EVENTS, x(marker, 23_500, 0)], rank=1, host="b")
    )
    traces = {0: r0, 1: r1}
    assert align(traces) == "clock markers (several hosts)"
    assert r1.offset == -3_500 and marker_skew_us(traces) == 0


def test_parallel_parse_matches_serial(tmp_path):
    for r in range(2):
        write(tmp_path / f"rank{r}.json", CPU_EVENTS, rank=r)
    serial = load_traces(tmp_path, parallel=False)
    par = load_traces(tmp_path, parallel=True)
    assert [t.start.tolist() for t in serial.values()] == [t.start.tolist() for t in par.values()]


def slower(events, factor):
    """The same step with the compute op ``factor`` times as long (the rest shifted after it)."""
    out = []
    for e in events:
        e = dict(e)
        if e["name"] == "aten::mm":
            e["dur"] = int(e["dur"] * factor)
        out.append(e)
    return out


def test_plots_name_the_straggler_by_the_analysis_rule(tmp_path):
    from course_utils.profiling import draw

    write(tmp_path / "rank0.json", CPU_EVENTS, rank=0)
    write(tmp_path / "rank1.json", slower(CPU_EVENTS, 2.0), rank=1)
    a = analyse(load_traces(tmp_path))
    assert a.straggler() == 1
    ax = draw.timeline(a)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1 (straggler)"]
    ax = draw.breakdown_bars(a)
    assert "(straggler)" in ax.get_xticklabels()[1].get_text()
    assert "<- straggler" in a.table().splitlines()[3]  # rank 1's row
    balanced = analyse(load_traces(FIXTURES / "gpu_minimal"))  # 1 ms of 6: within the margin
    ax = draw.timeline(balanced, [5])  # what the step picker draws for one step
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert "straggler" not in balanced.table()


def test_a_lead_that_changes_hands_is_no_straggler(tmp_path):
    def two_steps(first, second):
        out = []
        for k, (factor, t0) in enumerate(((first, 0), (second, 200_000))):
            for e in slower(CPU_EVENTS, factor):
                out.append({**e, "ts": e["ts"] + t0, "name": e["name"].replace("#3", f"#{k}")})
        return out

    write(tmp_path / "rank0.json", two_steps(2.0, 1.0), rank=0)  # slow in step 0
    write(tmp_path / "rank1.json", two_steps(1.0, 2.0), rank=1)  # slow in step 1
    a = analyse(load_traces(tmp_path))
    assert [s["straggler"] for s in a.stragglers()] == [0, 1]
    assert a.straggler() is None


def test_table_columns_are_unambiguous():
    a = analyse(load_traces(FIXTURES / "gpu_minimal"))
    head = a.table().splitlines()[0]
    labels = [h.strip() for h in head.split("|")]
    assert labels == [
        "rank",
        "step time",
        "compute",
        "memory",
        "comm exposed",
        "data",
        "optimizer",
        "idle",
        "comm total",
        "comm hidden %",
    ]
    # the footer's account of the units holds for every row
    lines = a.table().splitlines()
    assert "Milliseconds per step" in lines[-1] and "except comm hidden %" in lines[-1]
    for line in lines[2:-1]:
        cells = [c.strip() for c in line.split("<-")[0].split("|")]
        assert cells[-1].endswith("%")
        step, compute, memory, exposed, data, optimizer, idle = map(float, cells[1:8])
        assert compute + memory + exposed + data + optimizer + idle == pytest.approx(step, abs=0.05)


def test_waiting_inside_an_annotation_is_not_compute(tmp_path):
    """DDP's forward waits for the buffer broadcast with no op running: that is communication."""
    events = [
        x("ProfilerStep#0", 0, 100_000, cat="user_annotation"),
        x("DistributedDataParallel.forward", 0, 80_000, cat="user_annotation"),
        x("c10d::broadcast_", 0, 1_000),  # enqueued on the training thread ...
        x(
            "gloo:broadcast", 0, 50_000, tid=2, cat="user_annotation"
        ),  # ... runs 50 ms on gloo's thread
        x("aten::convolution", 50_000, 30_000),
    ]
    (b,) = analyse({0: load_trace(write(tmp_path / "rank0.json", events))}).steps
    assert (b.compute, b.communication, b.comm_total, b.idle) == (30, 50, 50, 20)


def test_balanced_ranks_have_no_straggler(tmp_path):
    traces = {
        r: load_trace(write(tmp_path / f"rank{r}.json", CPU_EVENTS, rank=r)) for r in range(2)
    }
    a = analyse(traces)
    assert a.straggler() is None  # identical work: naming one would mislead
    assert len(a.stragglers()) == 1  # the per-step view still reports the (tied) maximum


def test_collectives_are_counted_on_every_thread(tmp_path):
    """On a GPU, DDP's all-reduces are issued by the autograd engine's device thread (tid 7 here),
    not the training thread; each call also leaves the backend's own event, counted once."""
    from course_utils.profiling.analysis import collectives_per_step

    events = [
        x("ProfilerStep#3", 0, 100_000, cat="user_annotation"),
        x("ProfilerStep#4", 100_000, 100_000, cat="user_annotation"),
        x("aten::mm", 1_000, 10_000),
    ]
    for step, n in ((0, 3), (100_000, 2)):
        for k in range(n):
            t = step + 20_000 + k * 10_000
            events += [
                x("c10d::allreduce_", t, 1_000, tid=7),
                x("nccl:all_reduce", t, 900, tid=7, cat="user_annotation"),
            ]
    t = load_trace(write(tmp_path / "rank0.pt.trace.json", events))
    assert collectives_per_step(t) == [3, 2]
    assert collectives_per_step(t, "all_gather") == [0, 0]
    with pytest.raises(ValueError, match="op must be one of"):
        collectives_per_step(t, "all-reduce")


def test_collectives_fall_back_to_backend_events_then_kernels(tmp_path):
    from course_utils.profiling.analysis import collectives_per_step

    steps = [x("ProfilerStep#1", 0, 50_000, cat="user_annotation")]
    gloo_only = steps + [x("gloo:all_reduce", 10_000, 100, tid=2, cat="user_annotation")] * 2
    t = load_trace(write(tmp_path / "a" / "rank0.pt.trace.json", gloo_only, mkdir=True))
    assert collectives_per_step(t) == [2]
    kernels = steps + [
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 30_000, 500, pid=0, tid=20, cat="kernel"),
        x("ncclDevKernel_AllGather_RING_LL(x)", 31_000, 500, pid=0, tid=20, cat="kernel"),
    ]
    t = load_trace(write(tmp_path / "b" / "rank0.pt.trace.json", kernels, mkdir=True))
    assert collectives_per_step(t) == [1] and collectives_per_step(t, "all_gather") == [1]


def test_collective_events_are_kernels_on_a_gpu_and_host_calls_on_cpu(tmp_path):
    """Where a rank waits in a collective: on NCCL inside the kernel (the host call only queues
    it), on gloo inside the host call. Notebook 04 splits exposed communication by these."""
    from course_utils.profiling.analysis import collective_events

    steps = [x("ProfilerStep#1", 0, 50_000, cat="user_annotation")]
    cpu = steps + [
        x("c10d::broadcast_", 1_000, 8_000),
        x("gloo:broadcast", 1_100, 7_800, tid=2, cat="user_annotation"),
        x("c10d::allreduce_", 20_000, 3_000),
    ]
    t = load_trace(write(tmp_path / "a" / "rank0.pt.trace.json", cpu, mkdir=True))
    names = lambda mask: sorted(t.names[i] for i in t.name_id[mask])  # noqa: E731
    assert names(collective_events(t, "broadcast")) == ["c10d::broadcast_", "gloo:broadcast"]
    assert names(collective_events(t, "all_reduce")) == ["c10d::allreduce_"]
    gpu = steps + [
        x("c10d::broadcast_", 1_000, 20),
        x("nccl:broadcast", 1_005, 10, cat="user_annotation"),
        x("ncclDevKernel_Broadcast_RING_LL(x)", 1_030, 9_000, pid=0, tid=20, cat="kernel"),
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 20_000, 500, pid=0, tid=20, cat="kernel"),
    ]
    t = load_trace(write(tmp_path / "b" / "rank0.pt.trace.json", gpu, mkdir=True))
    assert names(collective_events(t, "broadcast")) == ["ncclDevKernel_Broadcast_RING_LL(x)"]
    assert names(collective_events(t, "all_reduce")) == [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"
    ]
    with pytest.raises(ValueError, match="op must be one of"):
        collective_events(t, "bcast")


def _rank_paths(folder: Path) -> dict[int, Path]:
    return {int(p.name.split(".")[0].removeprefix("rank")): p for p in sorted(folder.iterdir())}


def test_hta_agrees_with_the_course_breakdown_on_gpu_traces():
    """Holistic Trace Analysis beside ours (notebook 04, section 9): on GPU traces its compute
    time is our compute, its non-compute time our memory plus exposed communication, and its
    communication/computation overlap our hidden share."""
    from course_utils.profiling.hta import summary

    paths = _rank_paths(FIXTURES / "gpu_minimal")
    out = summary(paths)
    ours = analyse(load_traces(FIXTURES / "gpu_minimal"))
    temporal = out["temporal"].set_index("rank")
    overlap = out["overlap"].set_index("rank")
    for rank in (0, 1):
        (b,) = [b for b in ours.steps if b.rank == rank]
        assert temporal.loc[rank, "compute_time(us)"] == pytest.approx(b.compute * 1e3)
        assert temporal.loc[rank, "non_compute_time(us)"] == pytest.approx(
            (b.memory + b.communication) * 1e3
        )
        assert overlap.loc[rank, "comp_comm_overlap_pctg"] == pytest.approx(
            100 * b.overlap, abs=0.01
        )


def test_hta_says_why_it_has_nothing_on_cpu_traces(monkeypatch):
    from course_utils.profiling.hta import summary

    out = summary(_rank_paths(FIXTURES / "cpu_gloo"))
    assert set(out) == {"why"} and "no GPU kernels" in out["why"]
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", None)  # as if not installed
    out = summary(_rank_paths(FIXTURES / "gpu_minimal"))
    assert "pip install HolisticTraceAnalysis" in out["why"]


def test_a_python_dispatch_modes_second_record_of_a_call_is_not_a_second_call(tmp_path):
    """Under a dispatch mode (modelled compute, the checks' watchers) the profiler records a call
    twice, the second inside a PythonDispatchMode event inside the first: one collective, and no
    work of its own."""
    from course_utils.profiling.analysis import collectives_per_step

    events = [
        x("ProfilerStep#1", 0, 50_000, cat="user_annotation"),
        x("c10d::allreduce_", 10_000, 5_000),
        x("PythonDispatchMode", 10_100, 4_800),
        x("c10d::allreduce_", 10_200, 4_600),
        x("c10d::allreduce_", 30_000, 1_000),  # a second, separate call
    ]
    t = load_trace(write(tmp_path / "rank0.pt.trace.json", events))
    assert collectives_per_step(t) == [2]
    assert classify_name("PythonDispatchMode") is None
    [b] = analyse_trace(t)
    assert b.compute == 0 and b.communication == pytest.approx(6.0)  # ms: 5 + 1, no compute
