"""The α–β model of communication, taught in notebook 03 and used by notebook 07's planner.

A message of ``m`` bytes between two ranks takes ``α + m / β`` seconds: ``α`` is the latency paid
per message (software, handshakes, the wire's delay), ``β`` the bandwidth of the link. Ring
collectives on ``n`` ranks send ``n - 1`` (reduce-scatter, all-gather) or ``2(n - 1)``
(all-reduce) messages of ``m / n`` bytes one after another around the ring, so::

    all-reduce:      2(n-1)·α + 2(n-1)/n · m/β
    all-gather:       (n-1)·α +  (n-1)/n · m/β     (m: the gathered buffer)
    reduce-scatter:   (n-1)·α +  (n-1)/n · m/β     (m: the input buffer)

Every step of a ring waits for the slowest link in it, so ``β`` is the slowest link's bandwidth.
Small messages are latency-bound (the α term dominates), large ones bandwidth-bound. The message
counts and byte factors come from :mod:`course_utils.comm.ledger`.

    python -c "from course_utils.comm.model import AlphaBeta; print(AlphaBeta(5e-6, 20e9).all_reduce(1e8, 8))"
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .ledger import ring_factor, ring_steps


@dataclass(frozen=True)
class AlphaBeta:
    """A link: ``alpha`` seconds per message, ``beta`` bytes per second."""

    alpha: float
    beta: float

    def __post_init__(self):
        if self.alpha < 0 or self.beta <= 0:
            raise ValueError(
                f"need alpha >= 0 and beta > 0, got alpha={self.alpha}, beta={self.beta}"
            )

    def p2p(self, nbytes: float) -> float:
        """Seconds for one message of ``nbytes`` between two ranks."""
        return self.alpha + nbytes / self.beta

    def ring(self, op: str, nbytes: float, n: int) -> float:
        """Seconds for a ring ``op`` on ``n`` ranks whose buffer is ``nbytes``: the ledger's
        messages in sequence, each paying ``alpha``, and its bytes per rank at ``beta``."""
        if n == 1:
            return 0.0
        return ring_steps(op, n) * self.alpha + ring_factor(op, n) * nbytes / self.beta

    def all_reduce(self, nbytes: float, n: int) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` on ``n`` ranks."""
        return self.ring("all_reduce", nbytes, n)

    def all_gather(self, nbytes: float, n: int) -> float:
        """Seconds for a ring all-gather whose gathered output is ``nbytes``."""
        return self.ring("all_gather", nbytes, n)

    def reduce_scatter(self, nbytes: float, n: int) -> float:
        """Seconds for a ring reduce-scatter of an ``nbytes`` input."""
        return self.all_gather(nbytes, n)


def fit(nbytes, seconds) -> AlphaBeta:
    """Least-squares ``α`` and ``β`` from one-way message times (``seconds[i]`` for ``nbytes[i]``)."""
    slope, intercept = np.polyfit(np.asarray(nbytes, float), np.asarray(seconds, float), 1)
    if slope <= 0:
        raise ValueError(
            "the times do not grow with the message size: measure larger messages, or on a quieter node"
        )
    return AlphaBeta(alpha=max(float(intercept), 0.0), beta=1.0 / float(slope))


def ping_pong_worker(ctx, sizes=(8, 1 << 10, 1 << 16, 1 << 20), repeats: int = 20) -> dict:
    """Ranks 0 and 1 bounce messages (run under ``launch``); the median one-way time per size.

    Blocking ``send`` / ``recv`` in alternation: only one message is ever in flight, so this is
    safe on NCCL too. Other ranks wait at the barrier. The sizes take turns, round after round,
    so that a busy moment on a shared node slows every size alike instead of one.
    """
    bufs = [torch.zeros(max(1, n // 4), dtype=torch.float32, device=ctx.device) for n in sizes]
    times: dict[int, list[float]] = {b.numel() * 4: [] for b in bufs}
    for i in range(repeats + 2):
        for buf in bufs:
            dist.barrier()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            t0 = time.perf_counter()
            if ctx.rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif ctx.rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            if i >= 2:  # the first round trips set up connections
                times[buf.numel() * 4].append((time.perf_counter() - t0) / 2)
    return {n: float(np.median(t)) for n, t in times.items()}


__all__ = ["AlphaBeta", "fit", "ping_pong_worker"]
