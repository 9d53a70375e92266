"""One training step of the course's own 3D composition: TP inside the stage, the 1F1B or GPipe
schedule over the PP group, then the DP gradient average (or ZeRO-1's reduce-scatter), timed."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..measure import synchronize
from ..modelled import ModelledCompute
from ..pipeline.schedules import StageRunner, train_step
from ..tensor_parallel import apply_tp, vocab_parallel_cross_entropy
from ..zero import ShardedOptimizer, count_model_states
from .dims import Groups, ParallelDims
from .stages import GPTStage, dp_slice, make_stage, stage_plan

DP_METHODS = ("ddp", "zero1")


def average_gradients(params, group) -> None:
    """The mean of every gradient over the DP ``group`` (each replica saw ``1/dp`` of the batch), in
    one all-reduce of a flat buffer, as DDP's buckets do: one message's latency, not one per
    parameter. A parameter with no gradient on this rank counts as zeros."""
    n = dist.get_world_size(group)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(n)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def modelled(tflops: float | None):
    """:class:`~course_utils.modelled.ModelledCompute` at ``tflops``, or nothing when None."""
    return ModelledCompute(tflops=tflops) if tflops is not None else contextlib.nullcontext()


def course_groups(dims: ParallelDims, build_groups=None) -> Groups:
    """This rank's TP, PP and DP groups: :meth:`ParallelDims.build`, or ``build_groups(dp, pp,
    tp)`` returning ``{"tp": (group, ranks), "pp": ..., "dp": ...}`` (a student's wiring)."""
    if build_groups is None:
        return dims.build()
    made = build_groups(dims.dp, dims.pp, dims.tp)
    return Groups(dims=dims, coords=dims.coords(dist.get_rank()), tp=made["tp"][0],
                  pp=made["pp"][0], dp=made["dp"][0],
                  ranks={d: list(made[d][1]) for d in ("tp", "pp", "dp")})  # fmt: skip


def course_stage(full, groups: Groups, dp_method: str, lr: float):
    """This rank's stage of ``full``, cut by TP over its group, its trained parameters and its
    optimizer: SGD, or
    ZeRO-1's :class:`~course_utils.zero.ShardedOptimizer` over the DP group."""

    dims = groups.dims
    stage = make_stage(full, dims, groups.coords.pp)
    if dims.tp > 1:
        apply_tp(stage, stage_plan(stage.first, stage.last), group=groups.tp)
    params = [p for p in stage.parameters() if p.requires_grad]
    if dp_method == "zero1":
        return (
            stage,
            params,
            ShardedOptimizer(params, torch.optim.SGD, process_group=groups.dp, lr=lr),
        )
    return stage, params, torch.optim.SGD(params, lr=lr)


def stage_runner(stage: GPTStage, groups: Groups, cfg, micro: int, dtype, device):
    """The schedule's runtime for ``stage`` over the PP group, micro-batches of ``micro``
    sequences; its loss is the vocabulary-parallel cross-entropy under TP (never gathers logits)."""

    def loss_fn(logits, y):  # logits (b, T, V/t)
        if groups.dims.tp > 1:
            return vocab_parallel_cross_entropy(logits, y, group=groups.tp)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    shape = (micro, cfg.seq_len, cfg.d_model)
    return StageRunner(
        stage, groups.coords.pp, groups.dims.pp, shape, shape, dtype, device, loss_fn,
        peers=groups.ranks["pp"], group=groups.pp,
    )  # fmt: skip


def course_step(ctx, parallel, opt, groups: Groups, batch, schedule: str, dp_method: str,
                micro_batches: int, compute=None) -> dict:  # fmt: skip
    """One timed step on this DP replica's slice of ``batch``: the schedule, the DP average, the
    optimizer. ``parallel``: this rank's ``stage``, its trained ``params`` and its ``runner``
    (:func:`stage_runner`). Returns the micro-batch losses, the model states held at the step's peak, and the
    wall and CPU seconds."""

    dims, me = groups.dims, groups.coords
    mx, my = (dp_slice(t, dims, me.dp) for t in batch)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    with modelled(compute):
        losses = train_step(
            parallel.runner, schedule, list(mx.chunk(micro_batches)), list(my.chunk(micro_batches))
        )
        if dp_method == "ddp" and dims.dp > 1:
            average_gradients(parallel.params, groups.dp)
        opt.step()
    states = count_model_states(parallel.stage, opt)  # gradients still held: the step's peak states
    opt.zero_grad()
    synchronize(ctx.device)  # GPU kernels run asynchronously: the clock waits for them
    step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    ctx.step()
    return {"losses": losses, "states": states, "step_s": step_s, "cpu_s": cpu_s}


def loss_diff(losses: list[float], group, dp: int, ref_loss: float, device) -> float:
    """|the batch's mean loss - the reference's|: this replica's mean over its micro-batches,
    averaged over the ``dp`` replicas of the DP ``group``."""
    mine = torch.tensor(sum(losses) / len(losses), dtype=torch.float64, device=device)
    dist.all_reduce(mine, group=group)
    return abs(mine.item() / dp - ref_loss)
