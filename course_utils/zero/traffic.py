"""Bytes the ZeRO stages send, counted where each collective is called.

The ZeRO paper (§7) counts a collective by the size of the buffer it works on: a reduce-scatter or
an all-gather of ``Ψ`` elements moves ``Ψ``, an all-reduce ``2Ψ`` (a reduce-scatter then an
all-gather). With a ring each rank actually sends ``(n−1)/n`` of that, which :attr:`sent` gives
(both from :mod:`course_utils.comm.ledger`).
Counting at the call site is the honest measure on gloo, which runs a reduce-scatter as an
all-reduce (twice the bytes, pytorch pull request 118911); on the wire, NCCL sends what :attr:`sent` says.

    with recording() as log:
        ...one training step...
    log.volume_bytes / (4 * num_params)   # 2.0 for stages 1 and 2, 3.0 for stage 3
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

from ..comm.ledger import ring_bytes, volume

_active: list[Traffic] = []


@dataclass
class Traffic:
    calls: Counter = field(default_factory=Counter)  # op -> number of calls
    volume: Counter = field(default_factory=Counter)  # op -> bytes, the paper's way
    sent_bytes: float = 0.0  # what each rank sends with ring algorithms

    @property
    def volume_bytes(self) -> int:
        return sum(self.volume.values())


def note(op: str, nbytes: int, n: int) -> None:
    """Record one collective ``op`` on a buffer of ``nbytes`` over ``n`` ranks."""
    for t in _active:
        t.calls[op] += 1
        t.volume[op] += volume(op, nbytes)
        t.sent_bytes += ring_bytes(op, nbytes, n)


@contextlib.contextmanager
def recording():
    """Count every collective the ZeRO stages call inside the block."""
    t = Traffic()
    _active.append(t)
    try:
        yield t
    finally:
        _active.remove(t)
