"""The pipeline as it really ran: F/B events from each stage's profiler trace, and its bubble.

The runtime labels every action ``pipeline:F{i}`` / ``pipeline:B{i}`` and the whole schedule
``pipeline:step`` (:mod:`.schedules`), so the trace of stage ``s`` holds when each micro-batch's
forward and backward ran there. The measured bubble of a stage is the fraction of the schedule
during which it ran neither: ``1 - busy / schedule``. Making the batch, ``zero_grad`` and the
optimizer step lie outside the schedule: they are not bubble, and are reported apart. Its time includes waiting in ``recv`` for a neighbour, which is exactly the
bubble, while the transfer itself overlaps the neighbour's work.

On a GPU the runtime makes each label span device time (it waits for its compute stream after
each receive and each action, :mod:`.schedules`), so the same reading holds there; without that
the labels would end when the CPU had *launched* the kernels, and the bubble would be the CPU's.
"""

from __future__ import annotations

import re

import numpy as np

from ..profiling.analysis import union
from ..profiling.trace import Trace
from .simulate import Action, Timed

LABEL = re.compile(r"^pipeline:([FB])(\d+)$")


def step_origin(traces: dict[int, Trace], step_index: int = -1) -> float:
    """The earliest start of recorded step ``step_index`` over all ranks, on their common clock
    (µs): pass it to :func:`stage_events` to draw every stage on one time axis."""
    return min(t.steps[step_index][1] + t.offset for t in traces.values())


def stage_events(trace: Trace, step_index: int = -1, origin_us: float | None = None) -> list[Timed]:
    """The F/B actions of one recorded step (default: the last) on this trace's stage, times in ms
    from ``origin_us`` on the ranks' common clock (:func:`step_origin`), or from this rank's own
    start of the step when it is not given (then the stages' axes do not line up).

    A labelled action starts with a blocking receive; the time spent waiting there is not work, so
    each action's start is moved to the end of its receive: the runtime's ``pipeline:recv`` label
    (which on a GPU ends when the data has arrived), else a ``c10d::recv`` or gloo event inside it.
    """
    _, s0, s1 = trace.steps[step_index]
    zero = s0 if origin_us is None else origin_us - trace.offset  # on this trace's clock
    main = trace.lane == trace.main_lane
    out = []
    recv_ids = [
        i
        for i, n in enumerate(trace.names)
        if n == "pipeline:recv" or n.startswith(("c10d::recv", "gloo:recv", "nccl:recv"))
    ]
    recv = np.isin(trace.name_id, recv_ids) & main
    for nid, name in enumerate(trace.names):
        m = LABEL.match(name)
        if not m:
            continue
        for idx in np.flatnonzero(
            (trace.name_id == nid) & main & (trace.start >= s0) & (trace.end <= s1)
        ):
            start, end = trace.start[idx], trace.end[idx]
            inner = recv & (trace.start >= start) & (trace.end <= end)
            if inner.any():
                start = trace.end[inner].max()
            out.append(
                Timed(
                    trace.rank,
                    Action(m.group(1), int(m.group(2)), trace.rank),
                    (start - zero) / 1e3,
                    (end - zero) / 1e3,
                )
            )
    return sorted(out, key=lambda t: t.start)


def _schedule_span_ms(trace: Trace, k: int) -> float:
    """ms of recorded step ``k`` inside the runtime's ``pipeline:step`` label: the schedule alone,
    without the data, ``zero_grad`` and the optimizer step around it (the whole step when the
    trace has no such label)."""
    _, s0, s1 = trace.steps[k]
    if "pipeline:step" in trace.names:
        nid = trace.names.index("pipeline:step")
        hit = (trace.name_id == nid) & (trace.start >= s0) & (trace.end <= s1)
        if hit.any():
            return float((trace.end[hit] - trace.start[hit]).sum()) / 1e3
    return (s1 - s0) / 1e3


def measured_bubble(traces: dict[int, Trace]) -> dict:
    """Per stage and overall: the idle fraction of the schedule in the recorded steps (work = F/B
    minus receive waits; the schedule = the ``pipeline:step`` label, which leaves out making the
    data, ``zero_grad`` and the optimizer step), and ``outside``: the share of each step that
    lies outside the schedule."""
    per_stage, outside = {}, {}
    for rank, t in traces.items():
        fractions, rest = [], []
        for k in range(len(t.steps)):
            events = stage_events(t, k)
            step_ms = (t.steps[k][2] - t.steps[k][1]) / 1e3
            span_ms = _schedule_span_ms(t, k)
            s, e = union(np.array([ev.start for ev in events]), np.array([ev.end for ev in events]))
            fractions.append(1.0 - float((e - s).sum()) / span_ms)
            rest.append(1.0 - span_ms / step_ms)
        per_stage[rank] = float(np.mean(fractions))
        outside[rank] = float(np.mean(rest))
    return {
        "per_stage": per_stage,
        "mean": float(np.mean(list(per_stage.values()))),
        "outside": outside,
    }
