"""The benchmark commands run end to end on small inputs and report what they claim to."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from course_utils.bench import traces as bench_traces
from course_utils.profiling.trace import load_trace


def test_generated_trace_is_a_valid_kineto_trace(tmp_path):
    path = tmp_path / "rank3.pt.trace.json"
    size = bench_traces.write_trace(path, rank=3, world_size=8, target_mb=0.3)
    t = load_trace(path)
    assert size > 0.25e6 and t.rank == 3 and t.rank_source == "distributedInfo"
    assert len(t.steps) >= 1 and any("gloo" in lane for lane in t.lanes)


def test_bench_traces_reports_times_and_memory():
    r = bench_traces.run(ranks=2, target_mb=0.3)
    assert r["ranks"] == 2 and r["steps"] >= 2 and r["events"] > 1000
    assert r["total_s"] == pytest.approx(r["parse_s"] + r["analyse_s"])
    assert r["worker_peak_rss_mb"] >= r["import_rss_mb"] > 0
    assert "parse + analyse" in bench_traces.table(r)


@pytest.mark.multiprocess
def test_bench_collectives_cli(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "course_utils",
            "bench",
            "collectives",
            "--world-size",
            "2",
            "--max-bytes",
            "4096",
            "--iters",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**__import__("os").environ, "COURSE_RUNS_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["world_size"] == 2 and {r["bytes"] for r in report["rows"]} == {1024, 4096}


def _one_rank_late(ctx, delay: float):
    """The collective benchmark with rank 1 sleeping ``delay`` after each of its calls: rank 1's
    loop then takes ``iters × delay`` and rank 0's one ``delay`` less (its last call returns as
    soon as rank 1 joins it)."""
    import time

    from course_utils.bench import collectives

    real = collectives._make_call

    def make(op, numel, n, device):
        call = real(op, numel, n, device)
        return (lambda: (call(), time.sleep(delay))) if ctx.rank == 1 else call

    collectives._make_call = make
    return collectives.bench_worker(ctx, ops=("all_reduce",), sizes=(1024,), iters=2, warmup=0)


@pytest.mark.multiprocess
def test_the_collective_benchmark_reports_the_slowest_rank(runs_root):
    """Per call: the slowest rank's time (the delay), not the sum (1.5x) nor the fastest (0.5x)."""
    from course_utils import launch

    delay = 0.25
    res = launch(_one_rank_late, 2, delay=delay, echo=False, timeout=60).results
    for out in res:  # every rank reports the same, all-reduced, time
        [row] = out["rows"]
        assert 0.95 * delay <= row["time_us"] / 1e6 <= 1.3 * delay, row
