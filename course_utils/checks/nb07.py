"""Checks for notebook 07 (3D parallelism): a rank's coordinates, the link each group uses, and
the groups themselves."""

from __future__ import annotations

import itertools

from ..measure import worst as worst_of
from ..parallel3d import compose_worker
from ..parallel3d.dims import ParallelDims
from ..plan import layouts
from . import common
from .common import fail, passed, refuse_calls

SHAPES = [(2, 2, 2), (2, 4, 2), (1, 1, 8), (8, 1, 1), (3, 2, 4), (2, 3, 1), (4, 2, 8), (1, 5, 3)]


def check_coords(coords) -> None:
    """Exercise 07.1: ``coords(rank, dp, pp, tp) -> (dp_index, pp_index, tp_index)``."""
    for dp, pp, tp in SHAPES:
        dims = ParallelDims(dp, pp, tp)
        for rank in range(dims.size):
            want = _reference(rank, dp, pp, tp)
            with refuse_calls("07.1", [ParallelDims, _reference],
                              "write the arithmetic, without ParallelDims.coords"):  # fmt: skip
                got = coords(rank, dp, pp, tp)
            if not (isinstance(got, tuple | list) and len(got) == 3):
                fail("07.1", f"return (dp_index, pp_index, tp_index); got {got!r}")
            got = tuple(int(v) for v in got)
            if got == want:
                continue
            where = f"rank {rank} of dp={dp} × pp={pp} × tp={tp}"
            if sorted(got) == sorted(want) and got != want and len(set(want)) == 3:
                hint = "return the indices in the order (dp_index, pp_index, tp_index)"
            elif any(not 0 <= v < d for v, d in zip(got, (dp, pp, tp))):
                hint = "each index must lie in 0 .. degree - 1 of its dimension"
            elif got[2] != want[2]:
                hint = "TP is the innermost dimension: ranks r and r+1 differ in their TP index"
            elif got[0] != want[0] and got[1] != want[1]:
                hint = (
                    "DP comes before PP from the inside: after the TP ranks come the DP "
                    "replicas of one stage, and a new stage starts every dp·tp ranks"
                )
            else:
                hint = f"{'DP' if got[0] != want[0] else 'PP'} index is off: rank = pp_index·(DP·TP) + dp_index·TP + tp_index, DP and TP the degrees"
            fail("07.1", f"{where}: your coordinates are {got}. {hint}.")
    passed("07.1", f"coordinates of every rank of {len(SHAPES)} grids, up to 64 ranks")


def _reference(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    return (rank // tp) % dp, rank // (tp * dp), rank % tp


def _links(dims: ParallelDims, gpus_per_node: int) -> dict[str, str]:
    out = {}
    for dim in ("tp", "pp", "dp"):
        one_node = all(len({r // gpus_per_node for r in g}) == 1 for g in dims.group_ranks(dim))
        out[dim] = "intra" if one_node else "inter"
    return out


PLANNER = (
    "that is the planner's own answer (course_utils.plan.placement): work out from the groups "
    "whether each one lies inside a node"
)


def check_links(links) -> None:
    """Exercise 07.2: ``links(dp, pp, tp, gpus_per_node) -> {"tp": ..., "pp": ..., "dp": ...}``,
    each ``"intra"`` when every group of that dimension lies inside one node, else ``"inter"``."""
    _check_links(links)


def _check_links(links) -> None:

    cases = list(itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4, 8), (4, 8)))
    cases += [(2, 1, 3, 4), (3, 1, 2, 4), (1, 3, 2, 4)]  # groups that straddle a node boundary
    for dp, pp, tp, g in cases:
        dims = ParallelDims(dp, pp, tp)
        want = _links(dims, g)
        with refuse_calls("07.2", [layouts.placement, layouts._placement, _links], PLANNER):
            got = links(dp, pp, tp, g)
        if not isinstance(got, dict) or set(got) != {"tp", "pp", "dp"}:
            fail("07.2", f"return a dict with the keys 'tp', 'pp' and 'dp'; got {got!r}")
        for dim in ("tp", "pp", "dp"):
            if got[dim] == want[dim]:
                continue
            where = f"dp={dp} × pp={pp} × tp={tp} on nodes of {g} GPUs"
            ranks = next(
                (grp for grp in dims.group_ranks(dim) if len({r // g for r in grp}) > 1), None
            )
            if ranks is not None:
                hint = f"its {dim.upper()} group {ranks} spans more than one node"
            else:
                hint = f"every {dim.upper()} group lies inside one node (node of rank r: r // {g})"
            fail("07.2", f"{where}: you said {dim} is {got[dim]!r}, but {hint}.")
    passed("07.2", f"the link of every dimension for {len(cases)} shapes and node sizes")


# ---- 07.3 the groups of every dimension --------------------------------------------------------

BUILT_FOR_YOU = (
    "that is the package's ParallelDims (its build, group_ranks, mesh) or torch's DeviceMesh, which "
    "builds the grid for you: enumerate the groups of each dimension yourself and create them"
)


def _groups_worker(ctx, build_groups, shapes):
    import torch
    import torch.distributed as dist

    r = ctx.rank

    def refusals(whole: bool = True):
        """The student's function alone: all of ParallelDims and torch's DeviceMesh; inside the
        course's 3D training (which uses ParallelDims itself), the methods that make groups."""
        import torch.distributed.device_mesh as dm

        made = [ParallelDims.build, ParallelDims.group_ranks, ParallelDims.mesh,
                ParallelDims.expert_mesh, ParallelDims._key]  # fmt: skip
        refs = [ParallelDims, dm.DeviceMesh] if whole else made
        return refuse_calls("07.3", [*refs, dm.init_device_mesh], BUILT_FOR_YOU)

    for dp, pp, tp in shapes:
        dims = ParallelDims(dp, pp, tp)
        want = {d: next(g for g in dims.group_ranks(d) if r in g) for d in ("tp", "pp", "dp")}
        with refusals():
            got = build_groups(dp, pp, tp)
        where = f"dp={dp} × pp={pp} × tp={tp}"
        if not isinstance(got, dict) or set(got) != {"tp", "pp", "dp"}:
            fail("07.3", f"return {{'tp': (group, ranks), 'pp': ..., 'dp': ...}}; got {got!r}")
        for d in ("tp", "pp", "dp"):
            group, ranks = got[d]
            if sorted(ranks) != want[d]:
                fail("07.3", f"{where}: rank {r}'s {d.upper()} group is {sorted(ranks)}; it should "
                     f"hold the ranks that differ from {r} in the {d.upper()} coordinate only")  # fmt: skip
            x = torch.tensor([float(r)], device=ctx.device)
            dist.all_reduce(x, group=group)
            if int(x.item()) != sum(want[d]):
                fail("07.3", f"{where}: an all-reduce over rank {r}'s {d.upper()} group summed to "
                     f"{int(x.item())}, not {sum(want[d])}: the group object is not the ranks "
                     "you listed (every rank must create every group, in the same order)")  # fmt: skip
    dp, pp, tp = shapes[0]
    with refusals(whole=False):
        out = compose_worker(ctx, dp, pp, tp, steps=2, build_groups=build_groups)
    worst = worst_of(out["diffs"])  # NaN if any is NaN
    if not worst < 1e-12:
        fail("07.3", f"3D training with your groups differs from one process by {worst:.2g}")
    return True


def check_groups(build_groups) -> None:
    """Exercise 07.3: ``build_groups(dp, pp, tp) -> {"tp": (group, ranks), "pp": ..., "dp": ...}``:
    this rank's three process groups, every group of every dimension created by every rank in the
    same order; checked on 8 ranks in several shapes, then used to train the 3D composition."""

    shapes = [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 4, 1)]
    common.launch_check(
        "07.3", _groups_worker, 8, build_groups=build_groups, shapes=shapes, timeout=180
    )
    passed("07.3", "every rank's TP, PP and DP groups on 8 ranks in 4 shapes, each group checked "
           "by an all-reduce, and DP × PP × TP trained with them equal to one process")  # fmt: skip


__all__ = ["check_coords", "check_groups", "check_links"]
