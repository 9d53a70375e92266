"""Checks for notebook 05 (pipeline parallelism): the 1F1B order, balanced stages, and the
mailbox that pairs a stage's sends with its next receive."""

from __future__ import annotations

import itertools
import random

from ..launcher import RankTimeoutError
from ..pipeline.partition import balanced_split, partition
from ..pipeline.simulate import schedule_order
from .common import ExerciseError, fail, launch_check, passed, refuse_calls
from .nb05_mailbox import mailbox_cases


def _as_pairs(actions) -> list[tuple[str, int]]:
    out = []
    for a in actions:
        kind, micro = (a.kind, a.micro) if hasattr(a, "kind") else (a[0], a[1])
        out.append((str(kind), int(micro)))
    return out


SIMULATOR = (
    "your function asked the simulator for the order (schedule_order, or simulate(), which calls "
    "it); the check compares with the simulator, so build the order yourself"
)


def check_one_f_one_b(one_f_one_b) -> None:
    """Exercise 05.1: ``one_f_one_b(p, m)``: per stage, the ("F"|"B", micro-batch) order of 1F1B."""
    fixed = [(2, 1), (2, 4), (3, 5), (4, 8), (4, 2), (4, 4), (8, 3), (5, 16)]
    drawn = random.Random().sample([(p, m) for p in range(2, 17) for m in range(1, 65)], 4)
    cases = fixed + drawn  # drawn afresh each call: an order built only for fixed pairs fails
    for p, m in cases:
        want = [_as_pairs(acts) for acts in schedule_order("1f1b", p, m, 1)]
        with refuse_calls("05.1", [schedule_order], SIMULATOR):
            got = one_f_one_b(p, m)
        if len(got) != p:
            fail("05.1", f"for p={p}, m={m} return one list per stage ({p}), got {len(got)}")
        for s, (mine, ref) in enumerate(zip(got, want)):
            mine = _as_pairs(mine)
            if mine == ref:
                continue
            if sorted(mine) != sorted(ref):
                fail(
                    "05.1",
                    f"stage {s} of p={p}, m={m}: every micro-batch needs exactly one F and one B "
                    "on every stage",
                )
            warm_mine = next((i for i, a in enumerate(mine) if a[0] == "B"), len(mine))
            warm_ref = next(i for i, a in enumerate(ref) if a[0] == "B")
            if warm_mine != warm_ref:
                fail(
                    "05.1",
                    f"stage {s} of p={p}, m={m}: your stage runs {warm_mine} forwards before its "
                    "first backward, which is not what 1F1B's chart shows for that stage. Count "
                    "them in the chart for each stage (and think of m < p: a stage cannot run more "
                    "forwards than there are micro-batches)",
                )
            fail(
                "05.1",
                f"stage {s} of p={p}, m={m}: after the warm-up, 1F1B alternates one forward and one "
                "backward, oldest micro-batch first, then drains the remaining backwards",
            )
    passed("05.1", f"1F1B order equal to the simulator's for {len(fixed)} (p, m) pairs and "
           f"{len(drawn)} drawn at random: {drawn}")  # fmt: skip


def _worst(costs, bounds) -> float:
    return max(sum(costs[a:b]) for a, b in bounds)


PACKAGE_SPLIT = (
    "that is the package's own balanced_split (partition() calls it too), which the check "
    "compares with: write the search over the cuts yourself"
)


def check_balanced_split(balanced_split_fn) -> None:
    """Exercise 05.2: ``balanced_split(costs, p)``: contiguous stages, the slowest as fast as possible."""
    rng = random.Random(0)
    cases = [
        ([1, 1, 1, 1], 2),
        ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2),
        ([5, 5, 5], 3),
        ([1, 9, 1, 9, 1], 3),
        ([10, 1, 1], 3),  # one layer alone reaches the best bottleneck: no stage may be empty
        ([1, 1, 10], 3),
    ]
    cases += [
        ([rng.randint(1, 20) for _ in range(rng.randint(4, 12))], p)
        for p in (2, 3, 4)
        for _ in range(5)
    ]
    cases = [(c, p) for c, p in cases if p <= len(c)]
    for costs, p in cases:
        best = _worst(costs, balanced_split(costs, p))  # before the package's name is refused
        with (
            refuse_calls("05.2", [balanced_split, partition], PACKAGE_SPLIT),
        ):
            got = [tuple(b) for b in balanced_split_fn(list(costs), p)]
        where = f"costs {costs} on {p} stages"
        if len(got) != p:
            fail("05.2", f"{where}: return {p} (start, end) ranges, got {len(got)}")
        if got[0][0] != 0 or got[-1][1] != len(costs) or any(a >= b for a, b in got):
            fail(
                "05.2",
                f"{where}: the ranges must be non-empty and cover every layer, from 0 to {len(costs)}",
            )
        if any(x[1] != y[0] for x, y in itertools.pairwise(got)):
            fail(
                "05.2",
                f"{where}: each stage must start where the previous one ends (contiguous layers)",
            )
        if _worst(costs, got) > best:
            fail(
                "05.2",
                f"{where}: your slowest stage costs {_worst(costs, got)}; a split exists whose slowest "
                "stage costs less. Try every place for the last cut, with the best split of the "
                "layers before it into p - 1 stages.",
            )
    passed("05.2", f"optimal contiguous splits for {len(cases)} cost lists")


# ---- 05.3 the mailbox -------------------------------------------------------------------------


def check_mailbox(mailbox_cls, timeout: float = 60) -> None:
    """Exercise 05.3: ``Mailbox(group)`` with ``send``, ``recv``, ``flush`` and ``wait_all``, run
    in the course's pipeline runtime (GPipe and 1F1B, 2 and 3 stages) against one process, with
    every point-to-point operation watched: each send leaves in one ``batch_isend_irecv`` with the
    stage's next receive (or with ``flush``), never on its own, and every send has completed when
    ``wait_all`` returns."""

    for p, cases in ((2, [("1f1b", 4), ("1f1b", 1)]), (3, [("1f1b", 5), ("gpipe", 3)])):
        try:
            launch_check("05.3", mailbox_cases, p, mailbox_cls=mailbox_cls, cases=cases,
                         timeout=timeout)  # fmt: skip
        except RankTimeoutError:
            runs = " or ".join(f"{schedule} with m={m}" for schedule, m in cases)
            raise ExerciseError(
                f"exercise 05.3: {runs} on {p} stages hung: two neighbours each waited for the "
                "other, or a receive never met its send"
            ) from None
    passed("05.3", "GPipe and 1F1B on 2 and 3 stages equal to one process, every send batched "
           "with the next receive or a flush, and complete when wait_all returns")  # fmt: skip
