"""How often to checkpoint: Young's and Daly's optimal interval, and the goodput it buys.

Saving every ``τ`` seconds of work costs ``C`` seconds per save; a failure (on average every
``M`` seconds, the job's mean time between failures) costs the restart ``R`` plus the work done
since the last save, on average half an interval. The waste per unit of time, to first order:
``C/τ + τ/(2M) + R/M``, smallest at Young's (1974) ``τ = sqrt(2·C·M)``. Daly (2006) adds the
higher-order terms; :func:`goodput` is his exact expectation for failures that arrive at random
(exponential times between them), and :func:`best_interval` the ``τ`` that maximizes it.

A job's MTBF shrinks with its size: ``M = M_gpu / G`` for ``G`` GPUs failing independently.
:data:`LLAMA3` is the failure rate Meta published for Llama 3 405B's pre-training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DAY = 86400.0


@dataclass(frozen=True)
class FailureRecord:
    """A published count of interruptions: ``unexpected`` of ``interruptions`` in ``days`` on
    ``gpus`` GPUs, from ``source``."""

    interruptions: int
    unexpected: int
    days: float
    gpus: int
    source: str

    def job_mtbf(self, gpus: int | None = None) -> float:
        """Seconds between unexpected interruptions for a job of ``gpus`` GPUs (default: the
        published job's), each GPU failing as often as theirs did."""
        per_job = self.days * DAY / self.unexpected
        return per_job * self.gpus / (gpus or self.gpus)


LLAMA3 = FailureRecord(
    interruptions=466,
    unexpected=419,
    days=54,
    gpus=16384,
    source="Llama Team, AI @ Meta, 'The Llama 3 Herd of Models', arXiv:2407.21783 (2024), "
    "§3.3.4 and Table 5: 466 job interruptions in a 54-day snapshot of pre-training on 16,384 "
    "H100 GPUs, 47 planned and 419 unexpected",
)
"""One unexpected interruption every 54 d / 419 = 3.09 hours for 16,384 GPUs."""


def young_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Young's optimal work between checkpoints, ``sqrt(2·C·M)`` (seconds in, seconds out)."""
    return math.sqrt(2 * checkpoint_cost * mtbf)


def daly_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum: ``sqrt(2CM)·(1 + sqrt(C/2M)/3 + (C/2M)/9) - C``
    while ``C < 2M``, else ``M``. Close to Young's when saving is cheap next to the MTBF."""
    c, m = checkpoint_cost, mtbf
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def waste_first_order(interval: float, checkpoint_cost: float, restart_cost: float,
                      mtbf: float) -> float:  # fmt: skip
    """The fraction of time not spent on new work, to first order: ``C/τ + τ/(2M) + R/M``
    (saving; redoing half an interval per failure; restarting)."""
    return checkpoint_cost / interval + interval / (2 * mtbf) + restart_cost / mtbf


def goodput(interval: float, checkpoint_cost: float, restart_cost: float, mtbf: float) -> float:
    """Useful work over wall time, Daly's (2006) exact expectation for exponential
    failures: ``τ / (M·e^(R/M)·(e^((τ+C)/M) - 1))``. Failures may strike during saves and
    restarts too."""
    m = mtbf
    x = (interval + checkpoint_cost) / m
    if x > 700 or restart_cost / m > 700:  # e^x overflows a float: next to no useful work
        return 0.0
    return interval / (m * math.exp(restart_cost / m) * math.expm1(x))


def best_interval(checkpoint_cost: float, restart_cost: float, mtbf: float) -> float:
    """The work between checkpoints that maximizes :func:`goodput`, to float precision. Setting
    its derivative to zero gives ``1 - e^(-(τ+C)/M) = τ/M``, one root in ``0 < τ < M`` (the left
    side minus the right falls as ``τ`` grows), found by bisection. ``R`` scales the goodput by
    ``e^(-R/M)`` and does not move the optimum; the root lies below Young's ``sqrt(2CM)``, close
    to it while ``C << M``. Exercise 11.3 (notebook 11) has the student search for it."""
    del restart_cost  # the optimum does not depend on it (see above)
    c = checkpoint_cost / mtbf
    lo, hi = 0.0, 1.0  # τ/M: the condition is positive at 0 and negative at 1
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if -math.expm1(-(mid + c)) > mid:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2 * mtbf


def expected_lost_work(interval: float, checkpoint_cost: float, restart_cost: float) -> float:
    """Seconds one failure costs on average, to first order: the restart plus half of an
    interval and its save (the work since the last complete checkpoint)."""
    return restart_cost + (interval + checkpoint_cost) / 2
