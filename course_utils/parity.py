"""One parity harness: a parallel model trained beside one process, compared after every step.

Every technique's equivalence check is the same experiment. From one seed, each rank builds a
single-process reference model and a copy of it; the technique parallelizes the copy for this
rank. Every step draws the same global batch on every rank: the reference trains on all of it,
the parallel model on this rank's part. After the step, the parallel parameters are compared
with the matching (slices of the) reference parameters and the largest absolute difference is
recorded. In float64 the two agree to rounding (~1e-12) whenever the technique is right.

A technique supplies only what differs: how to parallelize the copy, this rank's view of a batch
and of the parameters, and its training step. :func:`train_beside_reference` does the rest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .measure import max_abs_diff


@dataclass
class ParityRun:
    """What :func:`train_beside_reference` saw: per step, the largest parameter difference
    (``diffs``; empty without a reference), what the parallel step returned (``outputs``) and the
    reference's loss (``reference_losses``); and the objects trained, for a worker's own numbers."""

    model: Any
    optimizer: Any
    reference: nn.Module | None
    diffs: list[float] = field(default_factory=list)
    outputs: list = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)


def whole_batch_loss(reference: nn.Module, batch) -> float:
    """The default reference step's loss: cross-entropy on the whole batch ``(x, y)``, backward."""
    x, y = batch
    loss = F.cross_entropy(reference(x), y)
    loss.backward()
    return loss.item()


def train_beside_reference(
    make_model: Callable[[], nn.Module],
    parallelize: Callable[[nn.Module], tuple[Any, Any]],
    local_view: Callable[[Any, nn.Module], Iterable],
    batches: Iterable,
    train_step: Callable[[Any, Any, Any], Any],
    *,
    reference_optimizer: Callable[[Iterable], Any],
    shard: Callable[[Any], Any] = lambda batch: batch,
    reference_loss: Callable[[nn.Module, Any], float] = whole_batch_loss,
    reference: bool = True,
    reference_first: bool = True,
    seed: int = 0,
) -> ParityRun:
    """Train the parallel model and, with ``reference``, one process beside it; compare per step.

    ``make_model()``: the single-process model (built right after ``torch.manual_seed(seed)``).
    ``parallelize(copy) -> (model, optimizer)``: the technique on this rank, given a deep copy of
    the reference (the reference itself when ``reference=False``). ``local_view(model, ref)``:
    ``(parallel tensor, comparable reference tensor)`` pairs. ``batches``: the global batches, the
    same on every rank; ``shard(batch)``: this rank's part of one. ``train_step(model, optimizer,
    part)``: one whole parallel step (zero_grad, forward, backward, communication, optimizer step);
    what it returns is kept in ``outputs``. ``reference_loss(ref, batch)``: the reference's forward
    and backward on the whole batch, returning its loss; the harness zeroes the gradients before
    and steps ``reference_optimizer(params)`` after; the reference's gradients stay until the next
    step. ``reference_first=False`` runs each step's parallel part before the reference's (a
    timed step then starts with no reference work still queued on the device).
    """
    torch.manual_seed(seed)
    ref = make_model()
    model, optimizer = parallelize(copy.deepcopy(ref) if reference else ref)
    run = ParityRun(model, optimizer, ref if reference else None)
    ref_opt = reference_optimizer(ref.parameters()) if reference else None

    def reference_step(batch):
        ref_opt.zero_grad()
        run.reference_losses.append(reference_loss(ref, batch))
        ref_opt.step()

    for batch in batches:
        if reference and reference_first:
            reference_step(batch)
        run.outputs.append(train_step(model, optimizer, shard(batch)))
        if reference and not reference_first:
            reference_step(batch)
        if reference:
            run.diffs.append(max_abs_diff(local_view(model, ref)))  # NaN if any is NaN
    return run


def global_batches(steps: int, global_batch: int, features: int, classes: int, dtype, device,
                   seed: int):  # fmt: skip
    """``steps`` batches ``(x, y)``: ``x`` normal ``(global_batch, features)``, ``y`` class ids,
    drawn one step at a time from a generator seeded ``seed``, the same on every rank."""
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(global_batch, features, generator=data, dtype=dtype).to(device)
        y = torch.randint(classes, (global_batch,), generator=data).to(device)
        yield x, y
