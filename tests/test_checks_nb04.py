"""Notebook 04's exercise checks (04.1 exposed communication, 04.2 bus bandwidth): a right answer
passes; typical wrong ones and the package's own answers get the hint, never the answer.
"""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from course_utils import checks
from course_utils.bench import collectives
from course_utils.profiling.analysis import classify_name, subtract, union
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- 04.1 exposed communication ---------------------------------------------------------------


def exposed_communication_ms(trace, k):
    _, s0, s1 = trace.steps[k]
    cls = np.array([classify_name(n) or "" for n in trace.names], dtype=object)[trace.name_id]
    inside = (trace.end > s0) & (trace.start < s1)
    cpu = ~trace.lane_is_gpu[trace.lane]
    main = trace.lane == trace.main_lane
    is_op = ~trace.name_is_annotation[trace.name_id]

    def clipped(mask):
        return union(np.clip(trace.start[mask], s0, s1), np.clip(trace.end[mask], s0, s1))

    comm = clipped((cls == "communication") & cpu & inside)
    waiting = clipped((cls == "communication") & main & inside)
    compute = subtract(clipped((cls == "compute") & main & is_op & inside), waiting)
    parts = [
        compute,
        clipped((cls == "data") & cpu & inside),
        clipped((cls == "optimizer") & cpu & inside),
    ]
    busy = union(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    starts, ends = subtract(comm, busy)
    return float((ends - starts).sum()) / 1e3


def test_04_1_exposed_communication(capsys):
    checks.check_exposed_communication(exposed_communication_ms)
    assert "✓ exercise 04.1" in capsys.readouterr().out


def test_04_1_typical_mistakes():
    def all_communication(trace, k):
        _, s0, s1 = trace.steps[k]
        cls = np.array([classify_name(n) or "" for n in trace.names], dtype=object)
        m = (cls[trace.name_id] == "communication") & (trace.end > s0) & (trace.start < s1)
        s, e = union(np.clip(trace.start[m], s0, s1), np.clip(trace.end[m], s0, s1))
        return float((e - s).sum()) / 1e3

    def waiting_counts_as_compute(trace, k):  # forgets to take the c10d:: wait out of compute
        _, s0, s1 = trace.steps[k]
        cls = np.array([classify_name(n) or "" for n in trace.names], dtype=object)[trace.name_id]
        inside = (trace.end > s0) & (trace.start < s1)
        main = trace.lane == trace.main_lane

        def clipped(mask):
            return union(np.clip(trace.start[mask], s0, s1), np.clip(trace.end[mask], s0, s1))

        comm = clipped((cls == "communication") & inside)
        busy = clipped(
            ((cls == "compute") & main | (cls == "data") | (cls == "optimizer")) & inside
        )
        starts, ends = subtract(comm, busy)
        return float((ends - starts).sum()) / 1e3

    fails(checks.check_exposed_communication, all_communication, "all of the communication")
    fails(checks.check_exposed_communication, waiting_counts_as_compute, "too little")


def test_04_1_the_course_breakdown_is_refused():
    from course_utils.profiling import analysis

    def asks_analyse_trace(trace, k):
        return analysis.analyse_trace(trace)[k].communication

    def asks_analyse(trace, k):
        a = analysis.analyse({0: trace})
        return a.steps[k].communication

    def asks_by_imported_name(trace, k):
        from course_utils.profiling.analysis import analyse_trace

        return analyse_trace(trace)[k].communication

    source = inspect.getsource(analysis.analyse_trace).replace("def analyse_trace", "def mine")
    namespace = dict(vars(analysis))
    exec(compile(source, "<a notebook cell>", "exec"), namespace)  # pasted from the package
    pasted = namespace["mine"]
    assert pasted.__code__ is not analysis.analyse_trace.__code__

    def via_pasted(trace, k):  # the package's code pasted into a helper of the student's
        return pasted(trace)[k].communication

    def in_a_thread(trace, k):  # the refusal swaps the function's code: every thread sees it
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asks_analyse_trace, trace, k).result()

    for answer in (asks_analyse_trace, asks_analyse, asks_by_imported_name, in_a_thread):
        fails(checks.check_exposed_communication, answer, "analyse / analyse_trace")
    # a copy of the package's code pasted into a cell is not policed: it is the student's code now,
    # judged by what it computes (the checks refuse calls, not copies)
    checks.check_exposed_communication(via_pasted)


# ---- 04.2 bus bandwidth -----------------------------------------------------------------------

FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_bandwidth(op, nbytes, seconds, n):
    return nbytes / seconds / 1e9 * FACTORS[op](n)


def test_04_2_bus_bandwidth(capsys):
    checks.check_bus_bandwidth(bus_bandwidth)
    assert "✓ exercise 04.2" in capsys.readouterr().out


def test_04_2_typical_mistakes():
    def algorithm_bandwidth(op, nbytes, seconds, n):
        return nbytes / seconds / 1e9

    def all_reduce_like_the_others(op, nbytes, seconds, n):
        return nbytes / seconds / 1e9 * (1.0 if op == "broadcast" else (n - 1) / n)

    first = 1.048576 * 2 * (2 - 1) / 2  # all_reduce, 1 MiB in 1 ms on 2 ranks, in GB/s
    absent = [f"{first:.3g}", "2(n-1)/n", "2 (n - 1) / n"]
    fails(checks.check_bus_bandwidth, algorithm_bandwidth, "algorithm bandwidth", absent)
    fails(checks.check_bus_bandwidth, all_reduce_like_the_others, "send or receive", absent)


def test_04_2_looking_the_factor_up_is_refused():
    def looked_up(op, nbytes, seconds, n):  # collectives is imported in notebook 04
        return nbytes / seconds / 1e9 * collectives.bus_factor(op, n)

    original = collectives.bus_factor
    fails(checks.check_bus_bandwidth, looked_up, "work out each collective's factor yourself")
    assert collectives.bus_factor is original and collectives.bus_factor("broadcast", 4) == 1.0


def test_04_2_looking_the_ledger_up_is_refused():
    """The ring factor behind collectives.bus_factor (course_utils.comm) is refused too."""
    from course_utils.comm import ring_factor

    def ledger(op, nbytes, seconds, n):
        return nbytes / seconds / 1e9 * ring_factor(op, n)

    fails(checks.check_bus_bandwidth, ledger, "work out each collective's factor yourself")
    assert ring_factor("all_reduce", 4) == 1.5
