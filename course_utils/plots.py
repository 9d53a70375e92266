"""Plots the notebooks share. They draw parsed numbers, never screenshots."""

from __future__ import annotations

import matplotlib.pyplot as plt


def phase_bar(phases: dict[str, float], title: str = "Where a training step's time goes", ax=None):
    """One horizontal stacked bar: seconds per phase of a step, labelled in milliseconds."""
    ax = ax or plt.subplots(figsize=(9, 1.8))[1]
    left = 0.0
    colors = plt.get_cmap("tab10").colors
    for i, (name, seconds) in enumerate(phases.items()):
        ms = seconds * 1e3
        ax.barh(0, ms, left=left, color=colors[i % 10], label=f"{name} {ms:.1f} ms")
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("milliseconds per step")
    ax.set_title(title)
    ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=min(len(phases), 5), frameon=False
    )
    return ax


def compare_bars(rows: list[dict], metrics: list[tuple[str, str]], label_key: str = "config"):
    """Side-by-side bar charts, one per ``(key, axis label)`` in ``metrics``; rows missing a value
    are skipped. A row's ``(low, high)`` under ``key + " range"`` (its quartiles, say) is drawn as
    an error bar, so that a chart of medians shows how far apart they really are."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.2), squeeze=False)
    for ax, (key, label) in zip(axes[0], metrics):
        shown = [r for r in rows if r.get(key) is not None]
        spread = None
        if all(r.get(key + " range") for r in shown) and shown:
            spread = [[r[key] - r[key + " range"][0] for r in shown],
                      [r[key + " range"][1] - r[key] for r in shown]]  # fmt: skip
        ax.bar(range(len(shown)), [r[key] for r in shown], color="tab:blue", yerr=spread, capsize=4)
        ax.set_xticks(range(len(shown)), [r[label_key] for r in shown], rotation=20, ha="right")
        ax.set_ylabel(label)
    fig.tight_layout()
    return fig


def loss_curve(losses: list[float], steps_per_epoch: int | None = None, ax=None):
    """Training loss per step, with epoch boundaries as dotted lines."""
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    ax.plot(losses, lw=1.2)
    if steps_per_epoch:
        for e in range(steps_per_epoch, len(losses), steps_per_epoch):
            ax.axvline(e, ls=":", color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    return ax


def collective(name: str, before: list[list[float]], after: list[list[float]], ax_pair=None):
    """What every rank holds before and after a collective: one row per rank, one cell per element."""
    import numpy as np

    if ax_pair is None:
        _, ax_pair = plt.subplots(1, 2, figsize=(8, 0.5 * len(before) + 1.0))
    for ax, rows, title in zip(ax_pair, (before, after), ("before", "after")):
        width = max(len(r) for r in rows)
        grid = np.full((len(rows), width), np.nan)
        for i, r in enumerate(rows):
            grid[i, : len(r)] = r
        ax.imshow(grid, cmap="Blues", aspect="auto", vmin=0, vmax=np.nanmax(grid) * 1.3 or 1)
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:g}", ha="center", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [f"rank {i}" for i in range(len(rows))])
        ax.set_xticks([])
        ax.set_title(f"{name}: {title}")
    return ax_pair
