"""Notebook 07's exercise checks (07.1 coords, 07.2 links, 07.3 the groups on real gloo ranks): a
right answer passes; typical wrong ones and the package's planner get the hint.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from course_utils import checks
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- 07.1 coordinates, 07.2 links, 07.3 groups --------------------------------------------------


def coords(rank, dp, pp, tp):
    return rank // tp % dp, rank // (tp * dp), rank % tp


def links(dp, pp, tp, gpus_per_node):
    from course_utils.parallel3d import ParallelDims

    d = ParallelDims(dp, pp, tp)
    return {
        dim: "intra"
        if all(len({r // gpus_per_node for r in g}) == 1 for g in d.group_ranks(dim))
        else "inter"
        for dim in ("tp", "pp", "dp")
    }


def test_07_1_coords_and_07_2_links(capsys):
    checks.check_coords(coords)
    checks.check_links(links)
    out = capsys.readouterr().out
    assert "✓ exercise 07.1" in out and "✓ exercise 07.2" in out


def test_07_typical_mistakes():
    def pp_inside_dp(rank, dp, pp, tp):  # DP outermost: Megatron's order has PP outermost
        return rank // (tp * pp), rank // tp % pp, rank % tp

    def tp_outermost(rank, dp, pp, tp):
        return rank % dp, rank // dp % pp, rank // (dp * pp)

    def via_package(rank, dp, pp, tp):
        from course_utils.parallel3d import ParallelDims

        return tuple(ParallelDims(dp, pp, tp).coords(rank))

    def by_world_size(dp, pp, tp, g):  # the whole run fits in a node, else everything crosses
        return {d: "intra" if dp * pp * tp <= g else "inter" for d in ("tp", "pp", "dp")}

    def ignores_boundaries(dp, pp, tp, g):  # a group smaller than a node may still straddle two
        span = {"tp": tp, "dp": dp * tp if dp > 1 else 1, "pp": dp * pp * tp if pp > 1 else 1}
        return {d: "intra" if span[d] <= g else "inter" for d in span}

    fails(checks.check_coords, pp_inside_dp, "DP comes before PP")
    fails(checks.check_coords, tp_outermost, "TP is the innermost")
    fails(checks.check_coords, via_package, "without ParallelDims.coords")
    fails(checks.check_links, by_world_size, "lies inside one node")
    fails(checks.check_links, ignores_boundaries, "spans more than one node")


def test_07_2_the_planner_is_refused():
    from course_utils.plan import Choice, placement

    def via_planner(dp, pp, tp, g):
        return placement(Choice(dp, pp, tp), g)

    def via_module(dp, pp, tp, g):
        from course_utils.plan import layouts

        return dict(layouts._placement(dp, pp, tp, g))

    for answer in (via_planner, via_module):
        fails(checks.check_links, answer, "the planner's own answer")


def build_groups(dp, pp, tp):  # the model answer: every group of every dimension, in one order
    n, me = dist.get_world_size(), dist.get_rank()
    out = {}
    for dim in ("tp", "pp", "dp"):
        found = {}
        for r in range(n):
            c = {"tp": r % tp, "dp": r // tp % dp, "pp": r // (tp * dp)}
            found.setdefault(tuple(v for d, v in c.items() if d != dim), []).append(r)
        lists = sorted(found.values())
        group, _ = dist.new_subgroups_by_enumeration(lists)
        out[dim] = (group, next(g for g in lists if me in g))
    return out


def groups_swapped(dp, pp, tp):  # the DP and PP groups exchanged
    out = build_groups(dp, pp, tp)
    out["dp"], out["pp"] = out["pp"], out["dp"]
    return out


def groups_listed_not_made(dp, pp, tp):  # the right ranks, but every group is the whole world
    out = build_groups(dp, pp, tp)
    return {d: (None, ranks) for d, (_, ranks) in out.items()}


def groups_from_the_package(dp, pp, tp):
    from course_utils.parallel3d import ParallelDims

    g = ParallelDims(dp, pp, tp).build()
    return {d: (g.group(d), g.ranks[d]) for d in ("tp", "pp", "dp")}


@pytest.mark.multiprocess
def test_07_3_groups(runs_root, capsys):
    checks.check_groups(build_groups)
    assert "✓ exercise 07.3" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_07_3_typical_mistakes_and_bypasses(runs_root):
    fails(checks.check_groups, groups_swapped, "differ from")
    fails(checks.check_groups, groups_listed_not_made, "is not the ranks you listed")
    fails(checks.check_groups, groups_from_the_package, "builds the grid for you")
