"""Launching a pipeline: checks before any process starts, the per-rank worker, and equivalence.

    from course_utils.pipeline.run import run_pipeline
    res = run_pipeline(pipeline_mlp, "1f1b", p=2, m=4)       # every rank: max |param diff| per step

``schedule`` is one of the from-scratch ``naive`` / ``gpipe`` / ``1f1b``, or PyTorch's own
``torch_gpipe`` / ``torch_1f1b`` / ``torch_interleaved`` (``torch.distributed.pipelining`` with
manual ``PipelineStage``s; interleaved puts ``v`` chunks on each rank). Each rank also trains a
single-process copy of the whole model on the whole batch and reports the largest difference
between its stage's parameters and the copy's after every step (``diffs``); the last stage also
reports how far each step's loss, the mean of its micro-batch losses, is from the copy's
(``loss_diffs``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from ..compat import pipeline_losses, pipeline_schedule, pipelining_unsupported
from ..measure import max_abs_diff, synchronize
from ..modelled import ModelledCompute, describe
from .partition import boundary_shapes, check_sequential, partition
from .schedules import RUNTIME_SCHEDULES, StageRunner, train_step

TORCH_SCHEDULES = ("torch_gpipe", "torch_1f1b", "torch_interleaved")


def check_pipeline(
    make_model: Callable[[], nn.Module],
    p: int,
    m: int,
    global_batch: int,
    v: int = 1,
    schedule: str = "1f1b",
    world_size: int | None = None,
) -> None:
    """Every input error a pipeline run can have, raised before any process starts."""
    if world_size is not None and world_size != p:
        raise ValueError(
            f"world_size={world_size} does not match {p} stages: a pipeline runs one stage per rank "
            f"(v chunks per rank when interleaved). Launch {p} ranks, or cut the model into {world_size} stages."
        )
    if schedule not in RUNTIME_SCHEDULES + TORCH_SCHEDULES:
        raise ValueError(
            f"unknown schedule {schedule!r}: choose one of {RUNTIME_SCHEDULES + TORCH_SCHEDULES}"
        )
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}")
    if schedule == "naive" and m != 1:
        raise ValueError(f"the naive schedule runs the whole batch at once: m must be 1, got m={m}")
    if v < 1 or (v > 1 and schedule != "torch_interleaved"):
        raise ValueError(
            f"v={v} chunks per rank needs schedule='torch_interleaved' (the others hold one "
            "stage per rank): pass v=1, or choose the interleaved schedule"
        )
    chunks = p * v
    layers = len(check_sequential(make_model(), 1))
    if chunks > layers and v == 1:
        raise ValueError(
            f"{p} stages but the model has only {layers} layers: use at most {layers} stages"
        )
    if chunks > layers:
        raise ValueError(
            f"p={p} ranks x v={v} chunks = {chunks} virtual stages, but the model has only "
            f"{layers} layers: every stage needs at least one layer. Use p*v <= {layers}."
        )
    if global_batch % m:
        raise ValueError(
            f"a batch of {global_batch} does not split into m={m} equal micro-batches: "
            f"choose m among {[d for d in range(1, global_batch + 1) if global_batch % d == 0]}"
        )
    if schedule == "torch_interleaved" and (v < 2 or m % p):
        raise ValueError(
            f"torch_interleaved needs v >= 2 chunks per rank and m a multiple of p; got v={v}, m={m}, p={p}"
        )


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
    p, rank = ctx.world_size, ctx.rank
    if compute is not None and compare:
        raise ValueError(
            "modelled compute returns zeros for every product: pass compare=False (check parity "
            "in a run without it)"
        )
    modelled = ModelledCompute(tflops=compute) if compute is not None else contextlib.nullcontext()
    torch.manual_seed(seed)
    model = make_model().to(ctx.device, dtype)
    reference = make_model().to(ctx.device, dtype) if compare else None
    if reference is not None:
        reference.load_state_dict(model.state_dict())
    loss_fn = nn.functional.cross_entropy
    data = torch.Generator().manual_seed(seed + 1)
    micro = global_batch // m
    sample = torch.zeros(micro, d_in, dtype=dtype, device=ctx.device)
    chunks_per_rank = v if schedule == "torch_interleaved" else 1
    bounds = partition(model, p * chunks_per_rank, by=balance, sample=sample)
    my_chunks = [
        rank + p * j for j in range(chunks_per_rank)
    ]  # interleaved: rank r holds r, r+p, ...
    modules = [nn.Sequential(*list(model)[a:b]) for a, b in (bounds[c] for c in my_chunks)]
    params = [q for mod in modules for q in mod.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr) if reference is not None else None
    if schedule in RUNTIME_SCHEDULES:
        shapes = boundary_shapes(model, bounds, sample)
        runner = StageRunner(
            modules[0],
            rank,
            p,
            shapes[rank - 1] if rank else None,
            shapes[rank],
            dtype,
            ctx.device,
            loss_fn,
            mailbox_cls=mailbox_cls,
        )
    else:
        from torch.distributed.pipelining import PipelineStage

        stages = [
            PipelineStage(mod, c, p * chunks_per_rank, ctx.device)
            for mod, c in zip(modules, my_chunks)
        ]
    diffs, loss_diffs, times, losses = [], [], [], []
    for _ in range(steps):
        x = torch.randn(global_batch, d_in, generator=data, dtype=dtype).to(ctx.device)
        y = torch.randint(classes, (global_batch,), generator=data).to(ctx.device)
        opt.zero_grad()
        t0 = time.perf_counter()
        with modelled:
            if schedule in RUNTIME_SCHEDULES:
                losses = train_step(runner, schedule, list(x.chunk(m)), list(y.chunk(m)))
            else:
                losses = _torch_step(stages, schedule, m, x, y, loss_fn, rank == 0, rank == p - 1)
        opt.step()
        synchronize(ctx.device)  # GPU kernels run asynchronously: the clock waits for them
        times.append(time.perf_counter() - t0)
        ctx.step()  # drives the profiler under launch(..., profile=...)
        if reference is not None:
            opt_ref.zero_grad()
            ref_loss = loss_fn(reference(x), y)
            ref_loss.backward()
            opt_ref.step()
            if (
                rank == p - 1
            ):  # the last stage saw every micro-batch's loss: their mean is the step's
                loss_diffs.append(abs(sum(losses) / len(losses) - ref_loss.item()))
            ref_layers = list(reference)
            mine = [
                q
                for c in my_chunks
                for layer in ref_layers[bounds[c][0] : bounds[c][1]]
                for q in layer.parameters()
            ]
            diffs.append(max_abs_diff(zip(params, mine)))  # NaN if any is NaN
    out = {
        "diffs": diffs,
        "loss_diffs": loss_diffs,
        "step_s": times,
        "losses": losses,
        "bounds": bounds,
        "modelled": describe(compute, ctx.backend) if compute is not None else None,
    }
    if schedule in RUNTIME_SCHEDULES:
        out.update(
            peak_held_bytes=runner.peak_held_bytes,
            micro_bytes=max(runner.micro_bytes),
            timings=runner.timings,  # per step: the schedule's span, this stage's busy and bubble
        )
    return out


def run_pipeline(
    make_model,
    schedule: str,
    p: int,
    m: int,
    steps: int = 2,
    global_batch: int = 16,
    v: int = 1,
    launch_kwargs: dict | None = None,
    world_size: int | None = None,
    **worker_kwargs,
):
    """Check the arguments, then launch ``p`` ranks running :func:`pipeline_worker`.

    ``world_size``, when given, must equal ``p``: one stage per rank.
    """
    from ..launcher import launch
    from ..launcher.api import resolve_backend

    check_pipeline(make_model, p, m, global_batch, v, schedule, world_size)
    kwargs = {"timeout": 300, "echo": False, **(launch_kwargs or {})}
    if schedule in TORCH_SCHEDULES:
        backend, _ = resolve_backend(p, kwargs.get("backend", "auto"), kwargs.get("device", "auto"))
        why = pipelining_unsupported(schedule.removeprefix("torch_"), backend)
        if why:
            raise RuntimeError(why)
    return launch(
        pipeline_worker,
        p,
        make_model=make_model,
        schedule=schedule,
        m=m,
        steps=steps,
        global_batch=global_batch,
        v=v,
        **kwargs,
        **worker_kwargs,
    )
