"""Random numbers in a tensor-parallel model: which dropout masks must differ across ranks, and
which must not (Megatron-LM's RNG tracker).

Inside the tensor-parallel region each rank holds *different* heads (and MLP columns): one process
would draw an independent dropout mask for each head, so the ranks must draw different masks. Seed
every rank alike, as data-parallel code does, and rank 1's heads get exactly rank 0's masks: heads
``i`` and ``i + a/t`` are always dropped together. Outside it (the residual stream after ``g``,
LayerNorm without sequence parallelism) every rank holds the *same* activation, and the masks must
be the same on every rank, or the copies that are supposed to be identical drift apart.

Megatron-LM keeps two streams: the default one, seeded alike on the ranks of a tensor-parallel
group (it adds ``100 ×`` the pipeline rank to the seed), and a
tensor-parallel one seeded with ``seed + 2718 + tp_rank``, which ``fork()`` swaps in for the
operations inside the region (the attention probabilities' dropout). :class:`ForkedDropout` is
that dropout, and ``apply_tp``'s ``dropout_tp`` style puts it in place of a model's module.
torch's DTensor does it differently on CUDA: a sharded tensor's random op advances the Philox
counter by each shard's offset, so the shards together draw exactly one device's mask; but torch's
tensor-parallel styles hand plain local tensors to the modules between them, whose random ops draw
from the ordinary stream.

    tracker = RNGTracker(seed=0)                  # inside a rank; group=None: every rank
    with tracker.fork():
        probs = F.dropout(probs, 0.1)             # this rank's own mask
Taught in notebook 06.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

OFFSET = 2718  # Megatron-LM's offset between the default and the tensor-parallel seed


class RNGTracker:
    """A tensor-parallel random stream, seeded ``seed + 2718 + rank in group``."""

    def __init__(self, seed: int = 0, group=None, device: torch.device | str = "cpu"):
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed + OFFSET + rank)

    @contextlib.contextmanager
    def fork(self):
        """Inside the block, the device's default random stream is the tensor-parallel one; after
        it, the default stream continues where it was and the tracker keeps its new state."""
        cuda = self.device.type == "cuda"
        saved = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
        state = self.generator.get_state()
        if cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)
        try:
            yield
        finally:
            now = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
            self.generator.set_state(now)
            if cuda:
                torch.cuda.set_rng_state(saved, self.device)
            else:
                torch.set_rng_state(saved)


class ForkedDropout(nn.Module):
    """Dropout whose mask comes from ``tracker``'s stream: different on every tensor-parallel rank."""

    def __init__(self, p: float, tracker: RNGTracker):
        super().__init__()
        self.p, self.tracker = p, tracker

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        with self.tracker.fork():
            return F.dropout(x, self.p, True)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream=tensor-parallel"


__all__ = ["OFFSET", "ForkedDropout", "RNGTracker"]
