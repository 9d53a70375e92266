"""The planner's links from measurements: ``α`` and ``β`` fitted to collective timings."""

from __future__ import annotations

from ..comm.model import AlphaBeta, fit


def fit_link(report: dict, op: str = "all_reduce") -> AlphaBeta:
    """``α`` and ``β`` of the link a ``bench collectives --json`` report ran on.

    A ring on ``n`` ranks takes ``k(n-1)·α + k(n-1)/n · size/β`` (``k = 2`` for all-reduce, 1 for
    all-gather and reduce-scatter), so ``time / (k(n-1)) = α + (size/n)/β``: a straight line in
    ``size/n``, fitted by least squares with :func:`course_utils.comm.model.fit`."""
    steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if op not in steps:
        raise ValueError(f"fit_link inverts the ring formulas of {sorted(steps)}, not {op!r}")
    n = report["world_size"]
    if n == 1:
        raise ValueError(
            "the report comes from 1 rank, which sends nothing: run "
            "`python -m course_utils bench collectives --world-size 2 --json` or more ranks"
        )
    rows = [r for r in report["rows"] if r["op"] == op]
    if len({r["bytes"] for r in rows}) < 2:
        have = sorted({r["op"] for r in report["rows"]})
        raise ValueError(
            f"the report has {len(rows)} {op} row(s) (it has {have or 'none'}); a line needs at "
            "least two message sizes: rerun bench collectives with a larger --max-bytes"
        )
    k = steps[op] * (n - 1)
    return fit([r["bytes"] / n for r in rows], [r["time_us"] * 1e-6 / k for r in rows])


__all__ = ["fit_link"]
