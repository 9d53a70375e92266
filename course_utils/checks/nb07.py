"""Checks for notebook 07 (3D parallelism): a rank's coordinates, and the link each group uses."""

from __future__ import annotations

import contextlib
import itertools

from ..topology import ParallelDims
from .common import fail, passed

SHAPES = [(2, 2, 2), (2, 4, 2), (1, 1, 8), (8, 1, 1), (3, 2, 4), (2, 3, 1), (4, 2, 8), (1, 5, 3)]


@contextlib.contextmanager
def _without(number: str, cls, name: str, message: str):
    """``cls.name`` raises while the student's code runs (write it yourself), then comes back."""
    original = getattr(cls, name)

    def refuse(*args, **kwargs):
        fail(number, message)

    setattr(cls, name, refuse)
    try:
        yield
    finally:
        setattr(cls, name, original)


def check_coords(coords) -> None:
    """Exercise 07.1: ``coords(rank, dp, pp, tp) -> (dp_index, pp_index, tp_index)``."""
    with _without(
        "07.1", ParallelDims, "coords", "write the arithmetic, without ParallelDims.coords"
    ):
        for dp, pp, tp in SHAPES:
            dims = ParallelDims(dp, pp, tp)
            for rank in range(dims.size):
                want = _reference(rank, dp, pp, tp)
                got = coords(rank, dp, pp, tp)
                if not (isinstance(got, tuple | list) and len(got) == 3):
                    fail("07.1", f"return (dp_index, pp_index, tp_index); got {got!r}")
                got = tuple(int(v) for v in got)
                if got == want:
                    continue
                where = f"rank {rank} of dp={dp} × pp={pp} × tp={tp}"
                if got[2] != want[2]:
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


def check_links(links) -> None:
    """Exercise 07.2: ``links(dp, pp, tp, gpus_per_node) -> {"tp": ..., "pp": ..., "dp": ...}``,
    each ``"intra"`` when every group of that dimension lies inside one node, else ``"inter"``."""
    cases = list(itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4, 8), (4, 8)))
    cases += [(2, 1, 3, 4), (3, 1, 2, 4), (1, 3, 2, 4)]  # groups that straddle a node boundary
    for dp, pp, tp, g in cases:
        dims = ParallelDims(dp, pp, tp)
        want = _links(dims, g)
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


__all__ = ["check_coords", "check_links"]
