"""What makes a restart equal an uninterrupted run bit for bit, besides the model and optimizer.

1. **Each rank's random generators** (CPU, and its GPU's): dropout masks, augmentations and noise
   drawn after the restart are the ones the uninterrupted run would have drawn. They differ per
   rank, so each rank keeps its own (``per_rank`` in :class:`~.sharded.ShardedState`).
2. **The data position**: the epoch (a ``DistributedSampler`` shuffles with ``seed + epoch``), the
   step within it (the batches already seen are skipped, not seen twice) and the sampler's seed.
3. **The step count**: learning-rate schedules and logging go on from it (Adam's own step count
   is in its state).

:func:`capture` packs them for :func:`~.sharded.save`; :func:`restore` puts them back from what
:func:`~.sharded.load` returned. The same idea as ``course_utils.train.common.gather_rng``, per rank
and without a gather: each rank writes its own states into its own file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.utils.data import DistributedSampler

from .sharded import Loaded


@dataclass
class DataPosition:
    """Where the data stream stands: the next batch is step ``step_in_epoch`` of ``epoch`` of a
    ``DistributedSampler`` seeded ``seed``."""

    epoch: int = 0
    step_in_epoch: int = 0
    seed: int = 0

    def advance(self, steps_per_epoch: int) -> None:
        """One step done: the next batch, or the first of the next epoch."""
        self.step_in_epoch += 1
        if self.step_in_epoch == steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def batch(self, num_samples: int, batch_size: int, rank: int, world_size: int) -> list[int]:
        """This rank's sample indices for the next step, as ``DistributedSampler`` orders them
        in this epoch (shuffled with ``seed + epoch``)."""
        sampler = DistributedSampler(
            range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=self.seed
        )
        sampler.set_epoch(self.epoch)
        order = list(sampler)
        start = self.step_in_epoch * batch_size
        return order[start : start + batch_size]


def rng_states(device: torch.device) -> dict:
    """This rank's generator states: ``cpu``, and ``cuda`` for a rank on a GPU."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device).cpu()
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    """Put back what :func:`rng_states` took."""
    torch.set_rng_state(states["cpu"].cpu())
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def capture(step: int, position: DataPosition, device: torch.device) -> tuple[dict, dict]:
    """``(meta, per_rank)`` for a :class:`~.sharded.ShardedState`: the step and data position
    (shared), this rank's generator states (its own)."""
    return {"step": step, "data": asdict(position)}, {"rng": rng_states(device)}


def restore(loaded: Loaded, device: torch.device, world_size: int) -> tuple[int, DataPosition]:
    """The step and data position saved, with this rank's generator states put back.

    A job restarted on another number of ranks has no states of its own: it goes on, with
    different random draws than the uninterrupted run (it says so)."""
    if loaded.saved_world_size == world_size and loaded.per_rank is not None:
        set_rng_states(loaded.per_rank["rng"], device)
    else:
        print(
            f"the checkpoint has random states for {loaded.saved_world_size} ranks, this job "
            f"{world_size}: training goes on with different random draws",
            flush=True,
        )
    return loaded.meta["step"], DataPosition(**loaded.meta["data"])
