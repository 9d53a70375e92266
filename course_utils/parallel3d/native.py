"""The same 3D training with torch's own pieces on one named ``DeviceMesh``: ``parallelize_module``
for TP, ``fully_shard`` (FSDP2) over DP, ``torch.distributed.pipelining`` over PP, trained beside
one process (:func:`torch_compose_worker`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..compat import fsdp2_unsupported, pipeline_losses, pipeline_schedule, pipelining_unsupported
from ..measure import synchronize
from ..models import GPT, GPTConfig
from ..parity import train_beside_reference
from .dims import ParallelDims
from .parity import gpt_reference_loss, loss_diffs
from .stages import GPTStage, batches, check_shape, dp_slice, make_stage


def torch_stage_plan(stage: GPTStage) -> dict:
    """torch's ``parallelize_module`` plan for one stage, as torchtitan writes it: the same shards
    as :func:`~.stages.stage_plan`; the head's logits are gathered (``Replicate``) so that the
    pipeline schedule's loss function sees ordinary tensors."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    if stage.first:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())  # vocabulary-parallel embedding
    for i in stage.blocks:
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(),
            f"blocks.{i}.mlp.up": ColwiseParallel(),
            f"blocks.{i}.mlp.down": RowwiseParallel(),
        }
    if stage.last:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def torch_stage(ctx, full, dims: ParallelDims, mesh, micro_batches: int, schedule: str, lr: float):
    """This rank's stage of ``full`` under TP (``mesh["tp"]``) and FSDP2 on every block and the
    stage (``mesh["dp"]``), its SGD optimizer, and the pipelining schedule over ``mesh["pp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor.parallel import parallelize_module

    me = dims.coords(ctx.rank)
    stage = make_stage(full, dims, me.pp)
    if dims.tp > 1:
        parallelize_module(stage, mesh["tp"], torch_stage_plan(stage))
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    opt = torch.optim.SGD(stage.parameters(), lr=lr)
    pipe = PipelineStage(stage, me.pp, dims.pp, ctx.device, group=mesh["pp"].get_group())
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    sched = pipeline_schedule(cls, pipe, micro_batches, loss_fn)
    return SimpleNamespace(stage=stage, sched=sched), opt


def torch_step(ctx, parallel, opt, batch, dims: ParallelDims) -> dict:
    """One timed step of the pipelining schedule on this DP replica's slice of ``batch``; the
    last stage's micro-batch losses."""

    stage, sched, me = parallel.stage, parallel.sched, dims.coords(ctx.rank)
    mx, my = dp_slice(batch[0], dims, me.dp), dp_slice(batch[1], dims, me.dp)
    dist.barrier()
    t0 = time.perf_counter()
    losses: list = []
    if stage.first and stage.last:
        sched.step(mx, target=my, losses=losses)
    elif stage.first:
        sched.step(mx)
    elif stage.last:
        sched.step(target=my, losses=losses)
    else:
        sched.step()
    opt.step()
    opt.zero_grad()
    synchronize(ctx.device)  # GPU kernels run asynchronously: the clock waits for them
    step_s = time.perf_counter() - t0
    ctx.step()
    return {"losses": pipeline_losses(sched, losses) if stage.last else None, "step_s": step_s}


def torch_compose_worker(
    ctx,
    dp: int,
    pp: int,
    tp: int,
    cfg: GPTConfig | None = None,
    global_batch: int = 8,
    micro_batches: int = 2,
    steps: int = 2,
    dtype: torch.dtype = torch.float64,
    schedule: str = "gpipe",
    lr: float = 0.1,
    seed: int = 0,
) -> dict:
    """The same training with torch's pieces on one ``DeviceMesh`` named ``("pp", "dp", "tp")``:
    ``parallelize_module`` over ``mesh["tp"]``, ``fully_shard`` (FSDP2, ZeRO-3) over
    ``mesh["dp"]`` on every block and the stage, and a ``torch.distributed.pipelining`` schedule
    over ``mesh["pp"]``. Compares every parameter (gathered with ``full_tensor``) and the loss with
    one process."""

    for why in (fsdp2_unsupported(ctx.device.type), pipelining_unsupported(schedule, ctx.backend)):
        if why:
            raise RuntimeError(why)
    cfg = cfg or GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    dims = ParallelDims(dp, pp, tp, world_size=ctx.world_size)
    check_shape(dims, cfg, global_batch, micro_batches)
    mesh = dims.mesh(ctx.device.type)

    def local_view(parallel, ref):
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p, ref.get_parameter(n))
                for n, p in parallel.stage.named_parameters()]  # fmt: skip

    run = train_beside_reference(
        lambda: GPT(cfg).to(ctx.device, dtype),
        lambda full: torch_stage(ctx, full, dims, mesh, micro_batches, schedule, lr),
        local_view,
        batches(cfg, global_batch, steps, seed, ctx.device),
        lambda parallel, opt, batch: torch_step(ctx, parallel, opt, batch, dims),
        reference_loss=gpt_reference_loss,
        reference_optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        reference_first=False,
        seed=seed,
    )
    stage = run.model.stage
    dp_group = mesh["dp"].get_group()
    mesh_ranks = {d: dist.get_process_group_ranks(mesh[d].get_group()) for d in ("pp", "dp", "tp")}
    return {"coords": tuple(dims.coords(ctx.rank)), "diffs": run.diffs,
            "loss_diffs": loss_diffs(run, dp_group, dp, ctx.device) if stage.last else [],
            "step_s": [o["step_s"] for o in run.outputs], "mesh_ranks": mesh_ranks,
            "dtensor": any(hasattr(p, "full_tensor") for p in stage.parameters())}  # fmt: skip
