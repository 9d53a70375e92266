"""The bytes a checkpoint holds per rank, by formula, under each layout.

A training checkpoint holds the parameters and the optimizer state, not the gradients (the next
step recomputes them). With Adam that is, per parameter, the parameter and two moments: ``(1 + 2)``
values, 24 bytes in float64 (the course's tests), 12 in float32; mixed precision keeps an fp32
master copy and fp32 moments (12 bytes; some frameworks also save the bf16 weights, ``2 + 12``,
which the master copy could regenerate). ``b`` below is the bytes per parameter
of all of them together (:func:`bytes_per_parameter`). For ``Ψ`` parameters over ``n`` ranks:

==========  ==========================================================================
layout      bytes rank ``r`` writes
==========  ==========================================================================
DDP         ``bΨ`` on rank 0, nothing elsewhere (every rank holds it all; the package's rule:
            the lowest rank writes a replicated tensor; DCP would split it over the ranks)
ZeRO-1/2/3  ``b·|[rS, (r+1)S) ∩ [0, Ψ)|``, ``S = ceil(Ψ/n)``: the stage does not matter, as
            gradients are not saved and the course saves parameters from the shards too (under
            ZeRO-1/2 every rank holds all parameters; it writes the 1/n it steps)
FSDP2       ``b·Σ`` rows ``chunk(n, 0)[r]`` of each parameter (about ``bΨ/n``)
TP          the cut tensors' ``1/t`` plus, on rank 0, the tensors every rank holds whole
PP          the stage's own layers, whole
==========  ==========================================================================

Adam's step count adds one 0-d tensor per parameter (a few bytes each); ``torch.save`` adds its
zip headers and pickle, a few hundred bytes per tensor: what :func:`~.sharded.save`'s files hold
beyond these formulas.
"""

from __future__ import annotations

import math

from .layouts import chunk_slice


def bytes_per_parameter(param_bytes: int = 4, moments: int = 2, state_bytes: int = 4,
                        master_bytes: int = 0) -> int:  # fmt: skip
    """``b``: a parameter, ``moments`` optimizer values (Adam: 2), a master copy if any."""
    return param_bytes + moments * state_bytes + master_bytes


def replicated_bytes(num_params: int, world_size: int, b: int) -> list[int]:
    """DDP: rank 0 writes everything."""
    return [b * num_params] + [0] * (world_size - 1)


def flat_bytes(num_params: int, world_size: int, b: int) -> list[int]:
    """ZeRO-1/2/3: rank ``r`` writes its stretch of the flat, padded buffer (padding excluded)."""
    step = math.ceil(num_params / world_size)
    return [b * max(0, min(num_params, (r + 1) * step) - r * step) for r in range(world_size)]


def chunked_bytes(shapes, world_size: int, b: int, dim: int = 0) -> list[int]:
    """FSDP2 (``dim=0``) or any ``torch.chunk``-style cut of every tensor: per rank."""
    return [
        b * sum(chunk_slice("", s, dim, r, world_size).numel for s in shapes)
        for r in range(world_size)
    ]


def tensor_parallel_bytes(cut: list[tuple[tuple[int, ...], int]], whole: list[tuple[int, ...]],
                          t: int, b: int) -> list[int]:  # fmt: skip
    """TP: ``cut`` the ``(shape, dim)`` of each tensor cut over ``t`` ranks; ``whole`` the shapes of
    those every rank holds whole (written once, by rank 0)."""
    per = [b * sum(chunk_slice("", s, d, r, t).numel for s, d in cut) for r in range(t)]
    per[0] += b * sum(math.prod(s) for s in whole)
    return per


def pipeline_bytes(stage_params: list[int], b: int) -> list[int]:
    """PP: each stage writes its own layers' ``stage_params[i]`` parameters."""
    return [b * n for n in stage_params]


def layout_bytes(layout: str, num_params: float, world_size: int, b: float, *, tp: int = 1,
                 balanced: bool = False) -> float:  # fmt: skip
    """The largest rank's bytes, paper style (layers cut evenly): the sizing question.

    Replicated state (DDP's everything; under ``"tp"``, each TP shard held by ``world_size / tp``
    data-parallel replicas) is written by the lowest rank holding it (the package's rule), or, with
    ``balanced``, split evenly over its holders (DCP's planner, or ZeRO-1 over the replicas)."""
    if layout == "ddp":
        return b * num_params / (world_size if balanced else 1)
    if layout == "tp":
        if world_size % tp:
            raise ValueError(f"tp={tp} must divide world_size={world_size}")
        return b * num_params / tp / (world_size // tp if balanced else 1)
    if layout in ("zero1", "zero2", "zero3", "fsdp2", "pp"):
        return b * num_params / world_size
    raise ValueError(f"layout must be ddp, zero1, zero2, zero3, fsdp2, tp or pp, not {layout!r}")
