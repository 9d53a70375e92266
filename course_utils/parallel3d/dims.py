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

**Context and expert parallelism** (notebooks 09, 10). ``cp`` shards the sequence; it sits between
TP and DP, as in Megatron-Core's ``tp-cp-ep-dp-pp`` order:
``rank = ((pp·DP + dp)·CP + cp)·TP + tp``. The weights are whole on every CP rank, so dense
gradients are reduced over DP × CP (the ``"dp_cp"`` group). ``ep`` shards the experts of a
mixture-of-experts layer over the DP × CP ranks of a stage and TP slot (it must divide
``dp·cp``): numbering those ranks ``d = dp·CP + cp``, an ``"ep"`` group is ``EP`` consecutive
``d`` (each holding different experts) and an ``"edp"`` group (expert data parallel) the ranks
holding the same experts, whose expert gradients are reduced together::

    >>> dims = ParallelDims(dp=4, pp=1, tp=1, ep=2)
    >>> dims.group_ranks("ep"), dims.group_ranks("edp")
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    >>> ParallelDims(dp=2, pp=1, tp=2, cp=2).group_ranks("cp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

DIMS = ("pp", "dp", "tp")
"""The dimensions from outermost to innermost (row-major order of the rank grid)."""

GRID = ("pp", "dp", "cp", "tp")
"""With context parallelism: the grid's dimensions from outermost to innermost."""

GROUPS = ("pp", "dp", "tp", "cp", "dp_cp", "ep", "edp")
"""Every group :meth:`ParallelDims.group_ranks` knows: the grid's dimensions, data × context
parallel together (where dense gradients are reduced), and the expert-parallel pair."""


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
    cp: int = 1
    """Context-parallel degree: ranks sharing one sequence (notebook 09)."""
    ep: int = 1
    """Expert-parallel degree: ranks sharing one MoE layer's experts, a split of dp·cp (10)."""

    def __post_init__(self):
        for name in ("dp", "pp", "tp", "cp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        if self.world_size is not None and self.size != self.world_size:
            cp = f" × cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"dp={self.dp} × pp={self.pp} × tp={self.tp}{cp} = {self.size}, but world_size "
                f"is {self.world_size}: choose degrees whose product is {self.world_size}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp × cp = {self.dp * self.cp}: the experts are spread "
                "over the data- (and context-) parallel ranks of a stage"
            )

    @property
    def size(self) -> int:
        """Ranks the grid holds, ``dp·pp·cp·tp``."""
        return self.dp * self.pp * self.cp * self.tp

    def degree(self, dim: str) -> int:
        if dim not in GROUPS:
            raise ValueError(f"dim must be one of {GROUPS}, got {dim!r}")
        derived = {"dp_cp": self.dp * self.cp, "edp": self.dp * self.cp // self.ep}
        return derived[dim] if dim in derived else getattr(self, dim)

    def rank(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """The rank at coordinates ``(dp, pp, tp)`` (and ``cp``):
        ``((pp·DP + dp)·CP + cp)·TP + tp``, which is ``pp·(DP·TP) + dp·TP + tp`` when ``cp = 1``."""
        for name, v in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp)):
            if not 0 <= v < self.degree(name):
                raise ValueError(f"{name}={v} is outside 0..{self.degree(name) - 1}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        """``(dp, pp, tp)`` of ``rank``: the inverse of :meth:`rank` when ``cp = 1``
        (:meth:`coord` gives any coordinate, ``cp`` included)."""
        c = self._all(rank)
        return Coords(dp=c["dp"], pp=c["pp"], tp=c["tp"])

    def coord(self, rank: int, dim: str) -> int:
        """``rank``'s index along ``dim`` (any of :data:`GROUPS`): its place in that group."""
        self.degree(dim)
        return next(g.index(rank) for g in self.group_ranks(dim) if rank in g)

    def _all(self, rank: int) -> dict:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside 0..{self.size - 1} ({self})")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        return {"pp": rest // self.dp, "dp": rest % self.dp, "cp": cp, "tp": tp}

    def _key(self, rank: int, dim: str) -> tuple:
        """What every rank of ``rank``'s ``dim`` group has in common."""
        c = self._all(rank)
        d = c["dp"] * self.cp + c["cp"]  # place among the stage's data × context ranks
        if dim == "dp_cp":
            return (c["pp"], c["tp"])
        if dim == "ep":
            return (c["pp"], c["tp"], d // self.ep)
        if dim == "edp":
            return (c["pp"], c["tp"], d % self.ep)
        return tuple(v for k, v in c.items() if k != dim)

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` (any of :data:`GROUPS`): for a grid dimension, the ranks that
        differ only in that coordinate; each list in increasing order, the lists ordered by their
        first rank."""
        self.degree(dim)
        groups: dict[tuple, list[int]] = {}
        for r in range(self.size):
            groups.setdefault(self._key(r, dim), []).append(r)
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
        ParallelDims(self.dp, self.pp, self.tp, dist.get_world_size(), self.cp, self.ep)  # size
        dims = list(DIMS)
        dims += ["cp", "dp_cp"] if self.cp > 1 else []
        dims += ["ep", "edp"] if self.ep > 1 else []
        mine, ranks = {}, {}
        for dim in dims:  # every rank in the same order
            group, _ = dist.new_subgroups_by_enumeration(self.group_ranks(dim), backend=backend)
            mine[dim] = group
            ranks[dim] = next(g for g in self.group_ranks(dim) if dist.get_rank() in g)
        return Groups(
            dims=self, coords=self.coords(dist.get_rank()), tp=mine["tp"], pp=mine["pp"],
            dp=mine["dp"], ranks=ranks, cp=mine.get("cp"), dp_cp=mine.get("dp_cp"),
            ep=mine.get("ep"), edp=mine.get("edp"),
        )  # fmt: skip

    def mesh(self, device_type: str):
        """The same grid as a ``DeviceMesh`` of shape ``(pp, dp, tp)`` with those names (``(pp,
        dp, cp, tp)`` when ``cp > 1``): ``mesh["tp"]`` is this rank's TP group as a 1-D mesh.
        Pass ``"cpu"`` explicitly on CPU ranks (a default mesh picks the accelerator where there
        is one; pytorch issue 132471)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.cp == 1:
            return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=DIMS)
        shape = (self.pp, self.dp, self.cp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=GRID)

    def expert_mesh(self, device_type: str):
        """The grid as the experts see it: a ``DeviceMesh`` of shape ``(pp, edp, ep, tp)``;
        ``mesh["ep"]`` shares one layer's experts, ``mesh["edp"]`` reduces their gradients."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.degree("edp"), self.ep, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp", "ep", "tp"))


@dataclass(frozen=True)
class Groups:
    """This rank's place: its coordinates, its three process groups, and their global ranks."""

    dims: ParallelDims
    coords: Coords
    tp: object
    pp: object
    dp: object
    ranks: dict  # {"tp": [...], "pp": [...], "dp": [...]}: global ranks of this rank's groups
    cp: object = None  # the groups below exist when their degree is above 1
    dp_cp: object = None
    ep: object = None
    edp: object = None

    def group(self, dim: str):
        if dim not in self.ranks:
            raise ValueError(f"no {dim!r} group was built (its degree is 1, or it is not a group)")
        return getattr(self, dim)


__all__ = ["DIMS", "GRID", "GROUPS", "Coords", "Groups", "ParallelDims"]
