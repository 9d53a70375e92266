"""A sharded checkpoint from scratch: every rank writes its own part, one index says where all is.

A checkpoint is a folder::

    step-00000010/
        index.json     every tensor: name, global shape, dtype, and which rank's file holds which
                       slice of it; the shared state (step, data position); each file's bytes
        shard-<r>.pt   rank r's slices (``torch.save`` of a dict of plain tensors; absent when
                       rank r holds nothing new, e.g. a DDP rank other than 0)
        rank-<r>.pt    rank r's own small state (its RNG states), when it has any

**What travels.** Saving: one ``all_gather_object`` of every rank's slice *descriptions* (no
tensors), so each rank knows which pieces it writes (a slice several ranks hold, a replicated
parameter, is written once, by the lowest rank: DCP deduplicates the same way), then each rank
writes its own file (no tensor crosses the network), then one ``gather_object`` of the file sizes to
rank 0, which writes the index. Loading: no communication at all; each rank reads, from the files it
needs, the stretches that overlap what it holds now. That is resharding: the index says where
every element is, so the reader's layout need not be the writer's.

**One index, written by rank 0 after the gather.** It exists only once every rank's file was
written, and it lists their sizes. Per-rank index files would leave the reader counting files to
decide whether a checkpoint is complete.

**Atomic: the rename is the commit.** Everything is written into ``<folder>.partial`` and fsynced
(the index too); rank 0 then renames it to ``<folder>``, and every rank waits for the rename. A
crash mid-save leaves a ``.partial`` folder, which :func:`latest` and :func:`load` never take for a
checkpoint (DCP, which writes in place, commits with its ``.metadata`` instead: :mod:`.dcp`).

Taught in notebook 11; the layouts' slices come from :mod:`.layouts`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

INDEX = "index.json"
PARTIAL = ".partial"
FORMAT = "course-sharded-1"


@dataclass(frozen=True)
class Slice:
    """The part of tensor ``name`` (shaped ``global_shape``) that one rank holds.

    A box: ``offsets[d] .. offsets[d] + lengths[d]`` along every dimension ``d`` (TP, FSDP2,
    whole tensors). ``flat=True``: one stretch ``offsets[0] .. offsets[0] + lengths[0]`` of the
    tensor flattened in row-major order (ZeRO's flat buffers cut parameters anywhere)."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    flat: bool = False

    def __post_init__(self):
        for attr in ("global_shape", "offsets", "lengths"):
            object.__setattr__(self, attr, tuple(int(v) for v in getattr(self, attr)))
        dims = 1 if self.flat else len(self.global_shape)
        extent = (math.prod(self.global_shape),) if self.flat else self.global_shape
        if len(self.offsets) != dims or len(self.lengths) != dims:
            raise ValueError(f"{self.name}: {dims} offsets and lengths expected, got {self}")
        for o, n, size in zip(self.offsets, self.lengths, extent):
            if o < 0 or n < 0 or o + n > size:
                raise ValueError(
                    f"{self.name}: slice {self.offsets}+{self.lengths} outside {extent}"
                )

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.lengths

    def runs(self) -> list[tuple[int, int]]:
        """The slice as ``(start, length)`` stretches of the flattened tensor, in the order the local
        tensor holds them (ascending): one per row of the dimensions not taken whole."""
        if self.numel == 0:
            return []
        if self.flat:
            return [(self.offsets[0], self.lengths[0])]
        shape = self.global_shape
        if not shape:
            return [(0, 1)]  # a 0-d tensor (Adam's step count)
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        j = len(shape) - 1  # dims after j are whole: one run spans them
        while j > 0 and self.offsets[j] == 0 and self.lengths[j] == shape[j]:
            j -= 1
        run = self.lengths[j] * strides[j]
        rows = itertools.product(*(range(o, o + n) for o, n in zip(self.offsets, self.lengths[:j])))
        base = self.offsets[j] * strides[j]
        return [(base + sum(i * s for i, s in zip(row, strides)), run) for row in rows]

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "lengths": list(self.lengths), "flat": self.flat}


@dataclass
class ShardedState:
    """What one rank saves: its ``(Slice, tensor)`` pairs, the ``meta`` every rank shares (JSON:
    step, data position; rank 0's is written) and its own ``per_rank`` state (RNG states)."""

    tensors: list[tuple[Slice, torch.Tensor]]
    meta: dict = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict)


@dataclass
class Loaded:
    """What :func:`load` read besides the tensors: the shared ``meta``, this rank's ``per_rank``
    state (``None`` if the checkpoint had no rank of that number or it saved none) and the world
    size that wrote it."""

    meta: dict
    per_rank: dict | None
    saved_world_size: int


def key_of(s: Slice) -> str:
    """A slice's key in its shard file: ``name[offsets]`` (``name{start}`` for a flat one)."""
    where = ",".join(map(str, s.offsets))
    return f"{s.name}{{{where}}}" if s.flat else f"{s.name}[{where}]"


def _fsync_save(obj, path: Path) -> int:
    """``torch.save`` to ``path``, flushed to disk; returns the file's bytes."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def _fsync_write(path: Path, text: str) -> None:
    """``path.write_text(text)``, flushed to disk: after a power loss the committed folder's rename
    must not be durable while the index it commits is empty."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _plan(mine: list[Slice], group, world_size: int) -> tuple[list[list[Slice]], set[int]]:
    """Every rank's slices (one ``all_gather_object`` of descriptions) and which of this rank's
    it writes: a slice held by several ranks (replicated) is written by the lowest of them."""
    everyone = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    first: dict[tuple, int] = {}
    for r, slices in enumerate(everyone):
        for s in slices:
            first.setdefault((s.name, s.offsets, s.lengths, s.flat), r)
    return everyone, first


def save(state: ShardedState, folder, *, rank: int, world_size: int, group=None) -> Path:
    """Write ``state`` as this rank's part of the checkpoint ``folder``; call on every rank.

    Returns ``folder`` once the checkpoint is complete (after every rank's file, the index and the
    rename). A rank that dies before that leaves only ``<folder>.partial``."""
    folder = Path(folder)
    partial = folder.with_name(folder.name + PARTIAL)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
        partial.mkdir(parents=True)
    _barrier(group, world_size)
    mine = [s for s, _ in state.tensors]
    _check_local(state.tensors)
    everyone, writer = _plan(mine, group, world_size)
    own = {key_of(s): _own_storage(t) for s, t in state.tensors
           if writer[(s.name, s.offsets, s.lengths, s.flat)] == rank}  # fmt: skip
    sizes = {}
    if own:
        sizes[f"shard-{rank}.pt"] = _fsync_save(own, partial / f"shard-{rank}.pt")
    if state.per_rank:
        sizes[f"rank-{rank}.pt"] = _fsync_save(state.per_rank, partial / f"rank-{rank}.pt")
    dtypes = {s.name: str(t.dtype).removeprefix("torch.") for s, t in state.tensors}
    gathered = [None] * world_size if rank == 0 else None
    if world_size > 1:
        dist.gather_object((sizes, dtypes), gathered, dst=_global(group, 0), group=group)
    else:
        gathered = [(sizes, dtypes)]
    if rank == 0:
        index = _index(everyone, writer, gathered, state.meta, world_size)
        _fsync_write(partial / INDEX, json.dumps(index, indent=1))  # on disk before the rename
        _commit(partial, folder)
    _barrier(group, world_size)
    return folder


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, copied if it views a larger storage: ``torch.save`` writes a view's whole
    storage, so a ZeRO slice (a view of the flat buffer) would otherwise write the full buffer."""
    t = t.detach().cpu()
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _check_local(pairs) -> None:
    for s, t in pairs:
        if t.numel() != s.numel:
            raise ValueError(f"{s.name}: local tensor of {t.numel()} elements for {s}")


def _index(everyone, writer, gathered, meta: dict, world_size: int) -> dict:
    """The index: per tensor its global shape, dtype and slices (who wrote which)."""
    tensors: dict[str, dict] = {}
    dtypes = {name: dt for _, d in gathered for name, dt in d.items()}
    for r, slices in enumerate(everyone):
        for s in slices:
            if writer[(s.name, s.offsets, s.lengths, s.flat)] != r:
                continue
            entry = tensors.setdefault(
                s.name,
                {"global_shape": list(s.global_shape), "dtype": dtypes[s.name], "slices": []},
            )
            if entry["global_shape"] != list(s.global_shape):
                raise ValueError(
                    f"{s.name}: ranks disagree on its global shape "
                    f"({entry['global_shape']} and {list(s.global_shape)} from rank {r})"
                )
            entry["slices"].append({"rank": r, "key": key_of(s), **s.to_json()})
    files = {name: size for sizes, _ in gathered for name, size in sizes.items()}
    return {"format": FORMAT, "world_size": world_size, "meta": meta, "files": files,
            "tensors": tensors}  # fmt: skip


def _commit(partial: Path, folder: Path) -> None:
    """Make ``partial`` the checkpoint ``folder`` by renames (a directory cannot replace a non-empty
    one in one ``os.replace``: an older checkpoint of the same name is moved aside first)."""
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(partial, folder)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(folder.parent, os.O_RDONLY)  # the renames themselves reach the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _barrier(group, world_size: int) -> None:
    if world_size > 1:
        dist.barrier(group=group)


def read_index(folder) -> dict:
    """The index of the complete checkpoint ``folder``; a clear error for an incomplete one."""
    folder = Path(folder)
    if folder.name.endswith(PARTIAL) or not (folder / INDEX).exists():
        raise FileNotFoundError(
            f"{folder} is not a complete checkpoint (no {INDEX}: a save that did not finish); "
            f"load the one latest() returns instead"
        )
    index = json.loads((folder / INDEX).read_text())
    for name, size in index["files"].items():
        path = folder / name
        if not path.exists() or path.stat().st_size != size:
            raise FileNotFoundError(f"{path}: missing or not the {size} bytes the index records")
    return index


def latest(root) -> Path | None:
    """The newest complete checkpoint under ``root`` (folders sorted by name, ``step-00000010``
    style), or ``None``. Folders without an index, ``.partial`` ones, never count."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.is_dir() and p.suffix not in (PARTIAL, ".old")]
    done = [p for p in sorted(done) if (p / INDEX).exists()]
    return done[-1] if done else None


def _overlaps(a: list[tuple[int, int]], b: list[tuple[int, int]]):
    """``(position in a's local tensor, position in b's, length)`` of every stretch both runs
    lists hold (both ascending): one sweep, as merging two sorted lists."""
    out, i, j = [], 0, 0
    a_at = list(itertools.accumulate([n for _, n in a], initial=0))
    b_at = list(itertools.accumulate([n for _, n in b], initial=0))
    while i < len(a) and j < len(b):
        (sa, na), (sb, nb) = a[i], b[j]
        lo, hi = max(sa, sb), min(sa + na, sb + nb)
        if lo < hi:
            out.append((a_at[i] + lo - sa, b_at[j] + lo - sb, hi - lo))
        if sa + na <= sb + nb:
            i += 1
        else:
            j += 1
    return out


def _saved_slice(name: str, entry: dict, s: dict) -> Slice:
    return Slice(name, tuple(entry["global_shape"]), s["offsets"], s["lengths"], s["flat"])


@torch.no_grad()
def load(folder, want: list[tuple[Slice, torch.Tensor]], *, rank: int) -> Loaded:
    """Fill each tensor of ``want`` (this rank's ``(Slice, tensor)`` pairs, any layout) from the
    checkpoint ``folder``, reading only the stretches of the saved slices that overlap it.

    Every element wanted must be in the checkpoint: otherwise an error names the tensor."""
    folder = Path(folder)
    index = read_index(folder)
    files: dict[int, dict] = {}
    for s, dst in want:
        entry = index["tensors"].get(s.name)
        if entry is None:
            raise KeyError(f"{s.name} is not in {folder}; it holds {sorted(index['tensors'])[:8]}…")
        if tuple(entry["global_shape"]) != s.global_shape:
            raise ValueError(
                f"{s.name}: saved with global shape {tuple(entry['global_shape'])}, "
                f"wanted {s.global_shape}"
            )
        if not dst.is_contiguous():
            raise ValueError(f"{s.name}: the tensor to fill must be contiguous")
        out, copied = dst.view(-1), 0
        for saved in entry["slices"]:
            pieces = _overlaps(_saved_slice(s.name, entry, saved).runs(), s.runs())
            if not pieces:
                continue
            if saved["rank"] not in files:
                path = folder / f"shard-{saved['rank']}.pt"
                files[saved["rank"]] = torch.load(path, mmap=True, weights_only=True)
            src = files[saved["rank"]][saved["key"]].reshape(-1)
            for at_src, at_dst, n in pieces:
                out[at_dst : at_dst + n].copy_(src[at_src : at_src + n])
                copied += n
        if copied != s.numel:  # fewer: a hole; more: saved slices that overlap each other
            raise ValueError(f"{s.name}: {copied} elements read for the {s.numel} wanted")
    per_rank = folder / f"rank-{rank}.pt"
    mine = torch.load(per_rank, weights_only=True) if per_rank.exists() else None
    return Loaded(index["meta"], mine, index["world_size"])


def renamed(pairs: list[tuple[Slice, torch.Tensor]], prefix: str) -> list:
    """``pairs`` with ``prefix`` before every name (two models in one checkpoint)."""
    return [(replace(s, name=prefix + s.name), t) for s, t in pairs]
