"""Pipeline schedules on paper: which stage runs which micro-batch when, and the bubble that results.

    from course_utils.pipeline.simulate import simulate
    s = simulate("1f1b", p=4, m=8)            # t_f = 1, t_b = 2 by default
    s.bubble, s.peak_in_flight                # 3/11, [4, 3, 2, 1]

Schedules (``m`` micro-batches, ``p`` stages, ``v`` model chunks per stage):

- ``gpipe``: all forwards, then all backwards (Huang et al., 2019). Every stage holds the
  activations of all ``m`` micro-batches at the end of the forward phase.
- ``1f1b``: ``p - s - 1`` warm-up forwards on stage ``s``, then one forward / one backward
  alternately, then the remaining backwards (PipeDream-Flush, Narayanan et al., 2021). The bubble is
  the same as GPipe's, ``(p-1)/(m+p-1)``, but a stage never holds more than ``p - s`` micro-batches.
- ``interleaved``: each stage holds ``v`` chunks (stage ``s`` has chunks ``s, s+p, ...``), each
  ``1/v`` of its layers (Megatron-LM). The bubble shrinks to ``(p-1)/(v*m + p - 1)``; ``m`` must be a
  multiple of ``p``.

The simulator places each stage's ordered actions as early as their dependencies allow: the
forward of chunk ``c`` needs chunk ``c-1``'s forward of the same micro-batch, and the backward of
``c`` needs chunk ``c+1``'s backward (or, on the last chunk, its own forward). Communication is free
here. Notebook 05 measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    micro: int
    chunk: int = 0
    """Model chunk (``stage + p * j`` for the j-th chunk of a stage); 0..p-1 without interleaving."""


@dataclass
class Timed:
    stage: int
    action: Action
    start: float
    end: float


@dataclass
class Schedule:
    name: str
    p: int
    m: int
    v: int
    t_f: float
    t_b: float
    order: list[list[Action]]
    """Per stage, the actions in the order the stage runs them."""
    timeline: list[Timed] = field(default_factory=list)

    @property
    def total(self) -> float:
        return max(t.end for t in self.timeline)

    @property
    def busy_per_stage(self) -> float:
        return (
            self.m * self.v * (self.t_f + self.t_b) / self.v
        )  # chunks take 1/v of the stage's time

    @property
    def bubble(self) -> float:
        """Idle fraction of each stage's time (the same for every stage)."""
        return 1.0 - self.busy_per_stage / self.total

    @property
    def peak_in_flight(self) -> list[float]:
        """Per stage: most micro-batch chunks forwarded but not yet backwarded at once, in units
        of one micro-batch's activations on the whole stage (a chunk counts ``1/v``)."""
        peaks = []
        for s in range(self.p):
            held, peak = 0.0, 0.0
            for a in self.order[s]:
                held += (1 if a.kind == "F" else -1) / self.v
                peak = max(peak, held)
            peaks.append(round(peak, 9))
        return peaks


def theory_bubble(p: int, m: int, v: int = 1) -> float:
    """Closed form: ``(p - 1) / (v*m + p - 1)``; GPipe and 1F1B have ``v = 1``."""
    return (p - 1) / (v * m + p - 1)


def schedule_order(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per stage, the actions of schedule ``name`` in the order that stage runs them (what
    :func:`simulate` places in time, and what the runtime of :mod:`.schedules` executes)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {SCHEDULES}")
    if name == "gpipe":
        return [
            [Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)]
            for s in range(p)
        ]
    if name == "1f1b":
        out = []
        for s in range(p):
            warm = min(p - s - 1, m)
            acts = [Action("F", i, s) for i in range(warm)]
            for i in range(m - warm):
                acts += [Action("F", warm + i, s), Action("B", i, s)]
            acts += [Action("B", i, s) for i in range(m - warm, m)]
            out.append(acts)
        return out
    # interleaved (Megatron-LM): micro-batches in groups of p, chunk order within each group
    total = m * v

    def fwd(k, s):
        group, pos = divmod(k, p * v)
        return Action("F", group * p + pos % p, s + p * (pos // p))

    def bwd(k, s):
        group, pos = divmod(k, p * v)
        return Action("B", group * p + pos % p, s + p * (v - 1 - pos // p))

    out = []
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        acts = [fwd(k, s) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(warm + k, s), bwd(k, s)]
        acts += [bwd(k, s) for k in range(total - warm, total)]
        out.append(acts)
    return out


def simulate(
    name: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float | None = None
) -> Schedule:
    """Place every action of schedule ``name`` in time (``t_f``, ``t_b``: one micro-batch on a whole stage)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1, m >= 1 and v >= 1, got p={p}, m={m}, v={v}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"v={v} chunks per stage needs the 'interleaved' schedule")
    if name == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs m to be a multiple of p: m={m}, p={p}")
    t_b = 2 * t_f if t_b is None else t_b
    sched = Schedule(name, p, m, v, t_f, t_b, schedule_order(name, p, m, v))
    last_chunk = p * v - 1
    done: dict[tuple, float] = {}
    cursor, clock = [0] * p, [0.0] * p
    remaining = sum(len(o) for o in sched.order)
    while remaining:
        progressed = False
        for s in range(p):
            while cursor[s] < len(sched.order[s]):
                a = sched.order[s][cursor[s]]
                if a.kind == "F":
                    dep = ("F", a.micro, a.chunk - 1) if a.chunk > 0 else None
                else:
                    dep = (
                        ("B", a.micro, a.chunk + 1)
                        if a.chunk < last_chunk
                        else ("F", a.micro, a.chunk)
                    )
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done.get(dep, 0.0) if dep else 0.0)
                end = start + (t_f if a.kind == "F" else t_b) / v
                done[(a.kind, a.micro, a.chunk)] = end
                sched.timeline.append(Timed(s, a, start, end))
                clock[s] = end
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} deadlocks for p={p}, m={m}, v={v}")
    return sched


def draw_timeline(
    timeline: list[Timed], p: int, ax=None, title: str = "", unit: str = "units of t_f"
):
    """One row per stage, F and B boxes labelled with their micro-batch (simulated or measured)."""
    import matplotlib.pyplot as plt

    span = max(t.end for t in timeline) - min(t.start for t in timeline)
    ax = ax or plt.subplots(figsize=(11, 0.5 * p + 1.2))[1]
    cmap = plt.get_cmap("tab20")
    chunked = any(t.action.chunk >= p for t in timeline)  # interleaved: v chunks per stage
    for t in timeline:
        color = cmap((t.action.micro % 10) * 2 + (1 if t.action.kind == "B" else 0))
        j = t.action.chunk // p  # which of its chunks the stage runs (0 without interleaving)
        ax.broken_barh(
            [(t.start, t.end - t.start)],
            (t.stage - 0.4, 0.8),
            facecolors=color,
            edgecolor="white",
            hatch="//" if chunked and j % 2 else None,
        )
        if (t.end - t.start) > span / 60:
            label = f"{t.action.kind}{t.action.micro}" + (f".{j}" if chunked else "")
            ax.text((t.start + t.end) / 2, t.stage, label, ha="center", va="center", fontsize=7)
    if chunked:
        title = (title + "\n" if title else "") + (
            "F3.1 = forward of micro-batch 3 through the stage's chunk 1 (hatched: odd chunks); "
            f"stage s holds chunks s, s+{p}, ..."
        )
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    return ax


def gantt(sched: Schedule, ax=None, title: str | None = None):
    """The simulated schedule as a Gantt chart, like the classic pipeline figure."""
    title = title or (
        f"{sched.name}: p={sched.p}, m={sched.m}"
        + (f", v={sched.v}" if sched.v > 1 else "")
        + f"   bubble {sched.bubble:.0%}"
    )
    return draw_timeline(sched.timeline, sched.p, ax, title)
