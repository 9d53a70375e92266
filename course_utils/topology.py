"""Where each rank sits in 3D parallelism: data (dp) × pipeline (pp) × tensor (tp) parallel.

A run of ``dp·pp·tp`` ranks is a grid. Every rank has coordinates ``(dp, pp, tp)`` and belongs to
three groups, one per dimension: the ranks that differ from it in that coordinate only.

The order of the dimensions decides which ranks are neighbours. Ranks are numbered with **TP
innermost, then DP, PP outermost**: ``rank = pp·(DP·TP) + dp·TP + tp``. This is the order of
Megatron-Core's ``parallel_state`` and of torchtitan's mesh (``("pp", "dp", "tp")``). Consecutive
ranks usually share a node, so TP, which talks at every layer, stays on the fastest link (NVLink);
DP talks once per step and PP sends one activation per micro-batch, so they can cross nodes.

Megatron-Core's example, 16 GPUs with tp=2, pp=4 (so dp=2)::

    >>> dims = ParallelDims(dp=2, pp=4, tp=2, world_size=16)
    >>> dims.group_ranks("tp")[:3]
    [[0, 1], [2, 3], [4, 5]]
    >>> dims.group_ranks("dp")[:3]
    [[0, 2], [1, 3], [4, 6]]
    >>> dims.group_ranks("pp")[:2]
    [[0, 4, 8, 12], [1, 5, 9, 13]]
    >>> dims.coords(13)
    Coords(dp=0, pp=3, tp=1)

Inside ranks, :meth:`ParallelDims.build` creates this rank's three process groups with
``torch.distributed.new_subgroups_by_enumeration``, and :meth:`ParallelDims.mesh` the same grid as
a ``DeviceMesh`` with named dimensions (for torch's ``parallelize_module``, ``fully_shard`` and
``torch.distributed.pipelining``). Taught in notebook 07.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

DIMS = ("pp", "dp", "tp")
"""The dimensions from outermost to innermost (row-major order of the rank grid)."""


class Coords(NamedTuple):
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of data, pipeline and tensor parallelism; ``world_size``, when given, is checked.

    ``ParallelDims(dp=2, pp=4, tp=2, world_size=8)`` raises ``ValueError: dp=2 × pp=4 × tp=2 = 16,
    but world_size is 8``.
    """

    dp: int
    pp: int
    tp: int
    world_size: int | None = None

    def __post_init__(self):
        for name in ("dp", "pp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        if self.world_size is not None and self.size != self.world_size:
            raise ValueError(
                f"dp={self.dp} × pp={self.pp} × tp={self.tp} = {self.size}, but world_size is "
                f"{self.world_size}: choose degrees whose product is {self.world_size}"
            )

    @property
    def size(self) -> int:
        """Ranks the grid holds, ``dp·pp·tp``."""
        return self.dp * self.pp * self.tp

    def degree(self, dim: str) -> int:
        if dim not in DIMS:
            raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
        return getattr(self, dim)

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """The rank at coordinates ``(dp, pp, tp)``: ``pp·(DP·TP) + dp·TP + tp``."""
        for name, v in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not 0 <= v < self.degree(name):
                raise ValueError(f"{name}={v} is outside 0..{self.degree(name) - 1}")
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        """``(dp, pp, tp)`` of ``rank``: the inverse of :meth:`rank`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside 0..{self.size - 1} ({self})")
        return Coords(
            dp=rank // self.tp % self.dp, pp=rank // (self.tp * self.dp), tp=rank % self.tp
        )

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` ("tp", "pp" or "dp"): the ranks that differ only in that
        coordinate, each list in increasing order, the lists ordered by their first rank."""
        self.degree(dim)
        groups: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)._asdict()
            key = tuple(v for k, v in c.items() if k != dim)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def build(self, backend: str | None = None) -> Groups:
        """Create every group of every dimension (all ranks must call this, in the same order) and
        return this rank's three. Needs an initialised default process group of ``size`` ranks."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims.build needs a process group: call it inside a rank started by "
                "course_utils.launch (or after torch.distributed.init_process_group)"
            )
        ParallelDims(self.dp, self.pp, self.tp, world_size=dist.get_world_size())  # checks the size
        mine, ranks = {}, {}
        for dim in DIMS:
            group, _ = dist.new_subgroups_by_enumeration(self.group_ranks(dim), backend=backend)
            mine[dim] = group
            ranks[dim] = next(g for g in self.group_ranks(dim) if dist.get_rank() in g)
        return Groups(
            dims=self, coords=self.coords(dist.get_rank()), tp=mine["tp"], pp=mine["pp"],
            dp=mine["dp"], ranks=ranks,
        )  # fmt: skip

    def mesh(self, device_type: str):
        """The same grid as a ``DeviceMesh`` of shape ``(pp, dp, tp)`` with those names: ``mesh["tp"]``
        is this rank's TP group as a 1-D mesh. Pass ``"cpu"`` explicitly on CPU ranks (a default
        mesh picks the accelerator where there is one; pytorch issue 132471)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=DIMS)


@dataclass(frozen=True)
class Groups:
    """This rank's place: its coordinates, its three process groups, and their global ranks."""

    dims: ParallelDims
    coords: Coords
    tp: object
    pp: object
    dp: object
    ranks: dict  # {"tp": [...], "pp": [...], "dp": [...]}: global ranks of this rank's groups

    def group(self, dim: str):
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}[dim]


__all__ = ["DIMS", "Coords", "Groups", "ParallelDims"]
