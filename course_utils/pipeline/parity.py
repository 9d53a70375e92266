"""The per-rank pipeline worker: trains this rank's stage and, beside it, one process.

:func:`pipeline_worker` (launched by :func:`~.run.run_pipeline`) runs one of the from-scratch
schedules or PyTorch's own (``torch.distributed.pipelining``) through
:func:`course_utils.parity.train_beside_reference`: every rank trains a single-process copy of the
whole model on the whole batch and compares its stage's parameters with the copy's after every
step (``diffs``); the last stage also compares each step's loss, the mean of its micro-batch
losses (``loss_diffs``). It also reports the step times, and the runtime's memory and timings.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from ..compat import pipeline_losses, pipeline_schedule
from ..measure import synchronize
from ..modelled import ModelledCompute, describe
from ..parity import global_batches, train_beside_reference
from .partition import boundary_shapes, partition
from .schedules import RUNTIME_SCHEDULES, StageRunner, train_step


def _torch_step(stages, schedule: str, m: int, x, y, loss_fn, first: bool, last: bool):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    cls = {
        "torch_gpipe": ScheduleGPipe,
        "torch_1f1b": Schedule1F1B,
        "torch_interleaved": ScheduleInterleaved1F1B,
    }[schedule]
    sched = pipeline_schedule(
        cls, stages if schedule == "torch_interleaved" else stages[0], m, loss_fn
    )
    losses: list = []
    if first and last:
        sched.step(x, target=y, losses=losses)
    elif first:
        sched.step(x)
    elif last:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return pipeline_losses(sched, losses)


def build_stage(ctx, model, schedule: str, v: int, balance: str, sample, loss_fn, mailbox_cls):
    """This rank's part of ``model``: the bounds of every chunk, its own chunks' modules and
    parameters, and what runs them (a :class:`StageRunner`, or torch's ``PipelineStage``s)."""
    p, rank = ctx.world_size, ctx.rank
    chunks_per_rank = v if schedule == "torch_interleaved" else 1
    bounds = partition(model, p * chunks_per_rank, by=balance, sample=sample)
    my_chunks = [rank + p * j for j in range(chunks_per_rank)]  # interleaved: r holds r, r+p, ...
    modules = [nn.Sequential(*list(model)[a:b]) for a, b in (bounds[c] for c in my_chunks)]
    stage = SimpleNamespace(bounds=bounds, chunks=my_chunks, runner=None, stages=None,
                            params=[q for mod in modules for q in mod.parameters()])  # fmt: skip
    if schedule in RUNTIME_SCHEDULES:
        shapes = boundary_shapes(model, bounds, sample)
        stage.runner = StageRunner(
            modules[0], rank, p, shapes[rank - 1] if rank else None, shapes[rank],
            sample.dtype, ctx.device, loss_fn, mailbox_cls=mailbox_cls,
        )  # fmt: skip
    else:
        from torch.distributed.pipelining import PipelineStage

        stage.stages = [
            PipelineStage(mod, c, p * chunks_per_rank, ctx.device)
            for mod, c in zip(modules, my_chunks)
        ]
    return stage


def timed_step(ctx, stage, opt, batch, schedule: str, m: int, loss_fn, modelled):
    """One training step of this rank's stage, timed: (the last stage's micro-batch losses, s)."""
    x, y = batch
    opt.zero_grad()
    t0 = time.perf_counter()
    with modelled:
        if schedule in RUNTIME_SCHEDULES:
            losses = train_step(stage.runner, schedule, list(x.chunk(m)), list(y.chunk(m)))
        else:
            first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
            losses = _torch_step(stage.stages, schedule, m, x, y, loss_fn, first, last)
    opt.step()
    synchronize(ctx.device)  # GPU kernels run asynchronously: the clock waits for them
    elapsed = time.perf_counter() - t0
    ctx.step()  # drives the profiler under launch(..., profile=...)
    return losses, elapsed


def stage_pairs(stage, reference):
    """``(parameter, reference parameter)`` for every parameter of this rank's chunks."""
    ref_layers = list(reference)
    mine = [
        q
        for c in stage.chunks
        for layer in ref_layers[stage.bounds[c][0] : stage.bounds[c][1]]
        for q in layer.parameters()
    ]
    return zip(stage.params, mine)


def pipeline_worker(
    ctx,
    make_model: Callable[[], nn.Module],
    schedule: str,
    m: int,
    steps: int = 2,
    global_batch: int = 16,
    d_in: int = 16,
    classes: int = 4,
    lr: float = 0.1,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    v: int = 1,
    balance: str = "params",
    compare: bool = True,
    mailbox_cls=None,
    compute: float | None = None,
) -> dict:
    """Train stage ``ctx.rank`` of the pipeline (under ``launch``); report equivalence, memory and time.

    ``compute``: run the steps under :class:`~course_utils.modelled.ModelledCompute` at this many
    TFLOP/s (products asleep, not computed: no parity then, ``compare`` must be False)."""
    if compute is not None and compare:
        raise ValueError(
            "modelled compute returns zeros for every product: pass compare=False (check parity "
            "in a run without it)"
        )
    modelled = ModelledCompute(tflops=compute) if compute is not None else contextlib.nullcontext()
    loss_fn = nn.functional.cross_entropy
    sample = torch.zeros(global_batch // m, d_in, dtype=dtype, device=ctx.device)

    def parallelize(model):
        stage = build_stage(ctx, model, schedule, v, balance, sample, loss_fn, mailbox_cls)
        return stage, torch.optim.SGD(stage.params, lr=lr)

    def reference_loss(reference, batch):
        ref_loss = loss_fn(reference(batch[0]), batch[1])
        ref_loss.backward()
        return ref_loss.item()

    run = train_beside_reference(
        lambda: make_model().to(ctx.device, dtype),
        parallelize,
        stage_pairs,
        global_batches(steps, global_batch, d_in, classes, dtype, ctx.device, seed + 1),
        lambda stage, opt, batch: timed_step(
            ctx, stage, opt, batch, schedule, m, loss_fn, modelled
        ),
        reference_loss=reference_loss,
        reference_optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        reference=compare,
        reference_first=False,
        seed=seed,
    )
    return pipeline_result(ctx, run, schedule, compute)


def pipeline_result(ctx, run, schedule: str, compute) -> dict:
    """The worker's report from its run: parity, step times, losses, and the runtime's memory."""
    last = (
        ctx.rank == ctx.world_size - 1
    )  # it saw every micro-batch's loss: their mean is the step's
    loss_diffs = [
        abs(sum(losses) / len(losses) - ref)
        for (losses, _), ref in zip(run.outputs, run.reference_losses)
    ] if last else []  # fmt: skip
    stage = run.model
    out = {
        "diffs": run.diffs,
        "loss_diffs": loss_diffs,
        "step_s": [t for _, t in run.outputs],
        "losses": run.outputs[-1][0] if run.outputs else [],
        "bounds": stage.bounds,
        "modelled": describe(compute, ctx.backend) if compute is not None else None,
    }
    if schedule in RUNTIME_SCHEDULES:
        out.update(
            peak_held_bytes=stage.runner.peak_held_bytes,
            micro_bytes=max(stage.runner.micro_bytes),
            timings=stage.runner.timings,  # per step: the schedule's span, this stage's busy and bubble
        )
    return out
