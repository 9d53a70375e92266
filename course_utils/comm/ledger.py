"""The ring collectives' accounting, written once: how many messages and how many bytes.

A ring collective on ``n`` ranks sends ``k(n-1)`` messages of ``m/n`` bytes one after another,
``k = 2`` for all-reduce (a reduce-scatter then an all-gather) and 1 for the others, so each rank
sends ``k(n-1)/n`` of the buffer ``m``. ``m`` is the size nccl-tests (``doc/PERFORMANCE.md``) and
the ZeRO paper (§7) use: the all-reduced tensor, the gathered output, the reduce-scattered input,
the all-to-all's input (of which ``1/n`` stays on the rank):

============== ========== ================ ===================
op             passes k   ring_factor(n)   volume (ZeRO §7)
============== ========== ================ ===================
all_reduce     2          2 (n - 1) / n    2 m
all_gather     1          (n - 1) / n      m
reduce_scatter 1          (n - 1) / n      m
all_to_all     1          (n - 1) / n      m
broadcast      1          1                m
============== ========== ================ ===================

A pipelined ring broadcast forwards the whole buffer through every rank, hence nccl-tests' bus
factor of 1. Used by :mod:`course_utils.comm.model` (α-β times), the collective benchmark's bus
bandwidth, tensor and expert parallelism's measured bytes and ZeRO's traffic.

    python -c "from course_utils.comm import ring_bytes; print(ring_bytes('all_reduce', 1e6, 8))"
"""

from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

# ring passes: an all-reduce goes round the ring twice, the others once
PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "broadcast": 1}


def _passes(op: str) -> int:
    if op not in PASSES:
        raise ValueError(f"unknown collective {op!r}: choose from {OPS}")
    return PASSES[op]


def ring_factor(op: str, n: int) -> float:
    """The share of the buffer each rank sends in a ring ``op`` on ``n`` ranks: ``2(n-1)/n`` for
    all-reduce, ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, 1 for broadcast
    (nccl-tests' bus-bandwidth factor)."""
    if op == "broadcast":
        return 1.0
    return _passes(op) * (n - 1) / n


def ring_steps(op: str, n: int) -> int:
    """Messages a ring ``op`` sends one after another on ``n`` ranks, each paying the latency."""
    return _passes(op) * (n - 1)


def volume(op: str, nbytes: int) -> int:
    """The ZeRO paper's count (§7) of a collective on an ``nbytes`` buffer: twice the buffer for
    an all-reduce (a reduce-scatter then an all-gather), the buffer for the others."""
    return _passes(op) * nbytes


def ring_bytes(kind: str, nbytes: int, t: int) -> float:
    """Bytes each rank sends in a ring ``kind`` whose full tensor is ``nbytes``, on ``t`` ranks:
    ``ring_factor(kind, t)`` of it (all-reduce ``2(t-1)/t``, all-gather and reduce-scatter
    ``(t-1)/t``; an all-to-all of equal splits ``(t-1)/t`` of its input, the rest stays on the
    rank); a ``"send"`` all of it; nothing on one rank."""
    if kind == "send":
        return float(nbytes)
    if t == 1:
        return 0.0
    return ring_factor(kind, t) * nbytes


__all__ = ["OPS", "PASSES", "ring_bytes", "ring_factor", "ring_steps", "volume"]
