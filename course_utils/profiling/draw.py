"""Drawing an :class:`~course_utils.profiling.analysis.Analysis`: timelines and breakdown bars."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .analysis import CLASSES, Analysis

COLORS = {
    "compute": "tab:blue",
    "memory": "tab:cyan",
    "communication": "tab:red",
    "data": "tab:green",
    "optimizer": "tab:purple",
    "idle": "lightgrey",
}


def timeline(
    analysis: Analysis, steps: list[int] | None = None, ax=None, highlight_straggler: bool = True
):
    """One lane per rank, coloured by class, for the chosen steps (default: all recorded steps)."""
    steps = steps or analysis.step_numbers()
    ranks = analysis.ranks()
    ax = ax or plt.subplots(figsize=(11, 0.55 * len(ranks) + 1.4))[1]
    chosen = [b for b in analysis.steps if b.step in steps]
    t0 = min(b.start_ms for b in chosen)
    for b in chosen:
        y = ranks.index(b.rank)
        for c, (s, e) in b.segments.items():
            ax.broken_barh(
                list(zip(s - t0, e - s)), (y - 0.4, 0.8), facecolors=COLORS[c], linewidth=0
            )
        ax.axvline(b.start_ms - t0, color="black", lw=0.4, alpha=0.3)
    slow = analysis.straggler() if highlight_straggler else None
    ax.set_yticks(
        range(len(ranks)), [f"rank {r}" + (" (straggler)" if r == slow else "") for r in ranks]
    )
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the first shown step began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in CLASSES]
    ax.legend(
        handles,
        CLASSES,
        ncol=6,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 - 0.05 * len(ranks)),
        frameon=False,
    )
    ax.set_title(f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}")
    return ax


def breakdown_bars(analysis: Analysis, ax=None):
    """Stacked bar per rank: mean ms per step in each class; the straggler's bar is outlined."""
    rows = analysis.per_rank()
    ax = ax or plt.subplots(figsize=(1.2 * len(rows) + 3, 3.2))[1]
    slow = analysis.straggler()
    bottom = [0.0] * len(rows)
    for c in CLASSES:
        vals = [r[c] for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, color=COLORS[c], label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        if r["rank"] == slow:
            ax.bar(i, bottom[i], fill=False, edgecolor="black", linewidth=2)
    ax.set_xticks(
        range(len(rows)),
        [f"rank {r['rank']}" + ("\n(straggler)" if r["rank"] == slow else "") for r in rows],
    )
    ax.set_ylabel("ms per step (mean)")
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", frameon=False)
    return ax


def step_picker(analysis: Analysis):
    """An ipywidgets slider that redraws the timeline for the chosen step."""
    import ipywidgets as widgets
    from IPython.display import display

    steps = analysis.step_numbers()
    out = widgets.Output()

    def draw(step: int) -> None:
        with out:
            out.clear_output(wait=True)
            timeline(analysis, [step])
            plt.show()

    slider = widgets.SelectionSlider(options=steps, value=steps[0], description="step")
    slider.observe(lambda change: draw(change["new"]), names="value")
    draw(steps[0])
    box = widgets.VBox([slider, out])
    display(box)
    return box
