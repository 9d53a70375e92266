"""3D parallelism: data × pipeline × tensor parallel on one GPT, checked against one process.

Each dimension runs over its own process group (:class:`~course_utils.topology.ParallelDims`):

- **TP** (notebook 06): inside a pipeline stage, :func:`~course_utils.tensor_parallel.apply_tp`
  cuts every block's ``qkv``/``up`` column-wise and ``proj``/``down`` row-wise, the embedding by
  vocabulary and the head column-wise; the loss is the vocabulary-parallel cross-entropy. Its
  all-reduces run over the TP group.
- **PP** (notebook 05): the GPT's blocks are split into ``pp`` contiguous stages (:class:`GPTStage`;
  the first also holds the embeddings, the last the final LayerNorm and the head), and the
  course's 1F1B or GPipe schedule (:class:`~course_utils.pipeline.schedules.StageRunner`) moves
  micro-batches between the ranks of the PP group. The TP rank ``t`` of stage ``s`` sends to the TP
  rank ``t`` of stage ``s+1``: activations between stages are whole (after TP's all-reduce), so
  every TP rank of a stage holds the same tensor, and each sends its own copy.
- **DP** (notebooks 03, 08): each DP replica trains on its slice of the global batch; gradients are
  averaged over the DP group after the pipeline's flush (``dp_method="ddp"``), or reduce-scattered
  into ZeRO-1 shards (``dp_method="zero1"``, :class:`~course_utils.zero.ShardedOptimizer`).

:func:`compose_worker` trains this and, on every rank, one single-process copy of the model on the
whole batch, and compares every parameter shard with the same slice of the reference.
:func:`torch_compose_worker` does the same with torch's own pieces on a named ``DeviceMesh``:
``parallelize_module`` for TP, ``fully_shard`` (FSDP2) over DP, ``torch.distributed.pipelining``
over PP. Taught in notebook 07; ``python -m course_utils bench 3d`` measures it.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .measure import max_abs_diff, synchronize
from .modelled import ModelledCompute, describe
from .models import GPT, GPTConfig
from .topology import Groups, ParallelDims

DP_METHODS = ("ddp", "zero1")


def stage_bounds(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """Blocks ``[a, b)`` of each of ``pp`` stages: contiguous, sizes differing by at most one, the
    extra blocks on the *middle* stages (the first and last also hold embeddings and head)."""
    if not 1 <= pp <= n_layers:
        raise ValueError(
            f"pp={pp} stages for {n_layers} layers: every stage needs at least one block, "
            f"so pp must be between 1 and {n_layers}"
        )
    base, extra = divmod(n_layers, pp)
    order = sorted(range(pp), key=lambda s: (s in (0, pp - 1), s))  # middle stages first
    sizes = [base + (1 if s in order[:extra] else 0) for s in range(pp)]
    bounds, a = [], 0
    for n in sizes:
        bounds.append((a, a + n))
        a += n
    return bounds


class GPTStage(nn.Module):
    """Stage ``[a, b)`` of a :class:`~course_utils.models.GPT`, sharing its modules.

    Its parameter names are the full model's (``blocks.2.attn.qkv.weight`` stays that), so a plan
    written for the GPT applies to the stage, and each shard finds its reference by name. The first
    stage maps token ids ``(B, T)`` to hidden states ``(B, T, h)``; middle stages map hidden states
    to hidden states; the last stage returns logits ``(B, T, V)`` (``V/t`` with TP).
    """

    def __init__(self, model: GPT, a: int, b: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos, self.drop = model.embed, model.pos, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(a, b)})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):  # (B, T) ids or (B, T, h) -> (B, T, h) or (B, T, V)
        if self.first:
            x = self.drop(self.embed(x) + self.pos.weight[: x.shape[1]])
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def stage_plan(first: bool, last: bool) -> dict[str, str]:
    """Megatron's GPT plan (:func:`~course_utils.tensor_parallel.gpt_plan`) for one stage: the
    embedding row only on the first stage, the head only on the last."""
    from .tensor_parallel import gpt_plan

    plan = gpt_plan()
    if not first:
        del plan["embed"]
    if not last:
        del plan["head"]
    return plan


def make_stage(model: GPT, dims: ParallelDims, pp_rank: int) -> GPTStage:
    a, b = stage_bounds(model.cfg.n_layers, dims.pp)[pp_rank]
    return GPTStage(model, a, b, pp_rank == 0, pp_rank == dims.pp - 1)


def check_shape(dims: ParallelDims, cfg: GPTConfig, global_batch: int, micro_batches: int) -> None:
    """Refuse, with the numbers, a shape the GPT or the batch cannot be split into."""
    stage_bounds(cfg.n_layers, dims.pp)
    for what, v in (("n_heads", cfg.n_heads), ("vocab", cfg.vocab)):
        if v % dims.tp:
            raise ValueError(f"tp={dims.tp} must divide the model's {what}={v}")
    if global_batch % (dims.dp * micro_batches):
        raise ValueError(
            f"global batch {global_batch} must split into dp={dims.dp} replicas × "
            f"{micro_batches} micro-batches"
        )


def batches(cfg: GPTConfig, global_batch: int, steps: int, seed: int = 0, device="cpu"):
    """``steps`` global batches ``(x, y)`` of token ids ``(B, T)``, the same on every rank; ``y`` is
    ``x`` shifted by one (next-token prediction)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(cfg.vocab, (global_batch, cfg.seq_len + 1), generator=gen)
        # contiguous, as a data loader hands them out: torch.distributed.pipelining (2.11) checks
        # a stage's input strides against its first micro-batch's and refuses a shifted view
        out.append((ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)))
    return out


def _dp_slice(x: torch.Tensor, dims: ParallelDims, dp_rank: int) -> torch.Tensor:
    return x.chunk(dims.dp)[dp_rank]


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


def _reference_step(ref, opt, x, y) -> float:
    """One SGD step of the single-process reference on the whole batch; its loss."""
    loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _loss_diff(losses: list[float], group, dp: int, ref_loss: float, device) -> float:
    """|the batch's mean loss - the reference's|: this replica's mean over its micro-batches,
    averaged over the ``dp`` replicas of the DP ``group``."""
    mine = torch.tensor(sum(losses) / len(losses), dtype=torch.float64, device=device)
    dist.all_reduce(mine, group=group)
    return abs(mine.item() / dp - ref_loss)


def modelled(tflops: float | None):
    """:class:`~course_utils.modelled.ModelledCompute` at ``tflops``, or nothing when None."""
    return ModelledCompute(tflops=tflops) if tflops is not None else contextlib.nullcontext()


def _max_diff(pairs) -> float:
    return max_abs_diff(pairs)  # NaN if any difference is NaN


def compose_worker(
    ctx,
    dp: int,
    pp: int,
    tp: int,
    cfg: GPTConfig | None = None,
    global_batch: int = 8,
    micro_batches: int = 2,
    steps: int = 2,
    dtype: torch.dtype = torch.float64,
    schedule: str = "1f1b",
    dp_method: str = "ddp",
    lr: float = 0.1,
    reference: bool = True,
    seed: int = 0,
    build_groups=None,
    compute: float | None = None,
) -> dict:
    """Train notebook 06's GPT with the course's own TP, pipeline schedule and DP (or ZeRO-1),
    each over its own group, and beside it (``reference=True``) one process on the whole batch.

    ``build_groups(dp, pp, tp)``, when given, creates the groups instead of
    :meth:`ParallelDims.build`: it returns ``{"tp": (group, ranks), "pp": ..., "dp": ...}`` for this
    rank (exercise 07.3 runs a student's wiring through the whole composition).

    Returns this rank's coordinates, per step the largest difference of its parameter shards from
    the same slices of the reference and (last stage) of the loss, the step times and the CPU time
    the rank's process used in each (``cpu_s``: real work, not waits or sleeps), and the bytes it
    held: model states (:func:`~course_utils.zero.count_model_states`) and the activations the
    schedule kept at its peak (:class:`~course_utils.pipeline.schedules.StageRunner`).

    ``compute``: run each step (schedule, DP average, optimizer) under
    :class:`~course_utils.modelled.ModelledCompute` at this many TFLOP/s per rank: the products
    sleep their FLOPs' time and return zeros, so the run times the schedule and its communication
    only (``reference`` must be False; check parity in a run without it). The result's
    ``"modelled"`` says so.
    """
    from .pipeline.schedules import StageRunner, train_step
    from .tensor_parallel import apply_tp, vocab_parallel_cross_entropy
    from .tensor_parallel.run import shard_like
    from .zero import ShardedOptimizer, count_model_states

    if dp_method not in DP_METHODS:
        raise ValueError(f"dp_method must be one of {DP_METHODS}, not {dp_method!r}")
    if compute is not None and reference:
        raise ValueError(
            "modelled compute returns zeros for every product: pass reference=False (check "
            "parity in a run without compute=...)"
        )
    cfg = cfg or GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    dims = ParallelDims(dp, pp, tp, world_size=ctx.world_size)
    check_shape(dims, cfg, global_batch, micro_batches)
    if build_groups is None:
        groups = dims.build()
    else:
        made = build_groups(dp, pp, tp)
        groups = Groups(dims=dims, coords=dims.coords(dist.get_rank()), tp=made["tp"][0],
                        pp=made["pp"][0], dp=made["dp"][0],
                        ranks={d: list(made[d][1]) for d in ("tp", "pp", "dp")})  # fmt: skip
    me = groups.coords
    torch.manual_seed(seed)
    full = GPT(cfg).to(ctx.device, dtype)
    ref = copy.deepcopy(full) if reference else None
    stage = make_stage(full, dims, me.pp)
    if tp > 1:
        apply_tp(stage, stage_plan(stage.first, stage.last), group=groups.tp)
    params = [p for p in stage.parameters() if p.requires_grad]
    if dp_method == "zero1":
        opt = ShardedOptimizer(params, torch.optim.SGD, process_group=groups.dp, lr=lr)
    else:
        opt = torch.optim.SGD(params, lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr) if reference else None

    def loss_fn(logits, y):  # logits (b, T, V/t): the vocabulary-parallel loss never gathers them
        if tp > 1:
            return vocab_parallel_cross_entropy(logits, y, group=groups.tp)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    b = global_batch // dp // micro_batches
    shape = (b, cfg.seq_len, cfg.d_model)
    runner = StageRunner(
        stage, me.pp, pp, shape, shape, dtype, ctx.device, loss_fn,
        peers=groups.ranks["pp"], group=groups.pp,
    )  # fmt: skip
    diffs, loss_diffs, times, cpu = [], [], [], []
    for x, y in batches(cfg, global_batch, steps, seed, ctx.device):
        mx, my = _dp_slice(x, dims, me.dp), _dp_slice(y, dims, me.dp)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with modelled(compute):
            losses = train_step(
                runner, schedule, list(mx.chunk(micro_batches)), list(my.chunk(micro_batches))
            )
            if dp_method == "ddp" and dp > 1:
                average_gradients(params, groups.dp)
            opt.step()
        states = count_model_states(stage, opt)  # gradients still held: the step's peak states
        opt.zero_grad()
        synchronize(ctx.device)  # GPU kernels run asynchronously: the clock waits for them
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        ctx.step()
        if not reference:
            continue
        ref_loss = _reference_step(ref, ref_opt, x, y)
        if stage.last:
            loss_diffs.append(_loss_diff(losses, groups.dp, dp, ref_loss, ctx.device))
        pairs = [
            (p, shard_like(ref.get_parameter(n), p, groups.tp)) for n, p in stage.named_parameters()
        ]
        diffs.append(_max_diff(pairs))
    return {
        "coords": tuple(me), "ranks": groups.ranks, "blocks": list(stage.blocks.keys()),
        "diffs": diffs, "loss_diffs": loss_diffs, "step_s": times, "cpu_s": cpu,
        "params": sum(p.numel() for p in stage.parameters()),
        "states_bytes": states.total, "peak_activation_bytes": runner.peak_held_bytes,
        "micro_activation_bytes": max(runner.micro_bytes), "backend": ctx.backend,
        "modelled": describe(compute, ctx.backend) if compute is not None else None,
    }  # fmt: skip


def torch_stage_plan(stage: GPTStage) -> dict:
    """torch's ``parallelize_module`` plan for one stage, as torchtitan writes it: the same shards
    as :func:`stage_plan`; the head's logits are gathered (``Replicate``) so that the pipeline
    schedule's loss function sees ordinary tensors."""
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
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor.parallel import parallelize_module

    from .compat import (
        fsdp2_unsupported,
        pipeline_losses,
        pipeline_schedule,
        pipelining_unsupported,
    )

    for why in (fsdp2_unsupported(ctx.device.type), pipelining_unsupported(schedule, ctx.backend)):
        if why:
            raise RuntimeError(why)
    cfg = cfg or GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    dims = ParallelDims(dp, pp, tp, world_size=ctx.world_size)
    check_shape(dims, cfg, global_batch, micro_batches)
    mesh = dims.mesh(ctx.device.type)
    me = dims.coords(ctx.rank)
    torch.manual_seed(seed)
    full = GPT(cfg).to(ctx.device, dtype)
    ref = copy.deepcopy(full)
    stage = make_stage(full, dims, me.pp)
    if tp > 1:
        parallelize_module(stage, mesh["tp"], torch_stage_plan(stage))
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    opt = torch.optim.SGD(stage.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    pipe = PipelineStage(stage, me.pp, pp, ctx.device, group=mesh["pp"].get_group())
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    sched = pipeline_schedule(cls, pipe, micro_batches, loss_fn)
    diffs, loss_diffs, times = [], [], []
    for x, y in batches(cfg, global_batch, steps, seed, ctx.device):
        mx, my = _dp_slice(x, dims, me.dp), _dp_slice(y, dims, me.dp)
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
        times.append(time.perf_counter() - t0)
        ctx.step()
        ref_loss = _reference_step(ref, ref_opt, x, y)
        if stage.last:
            values = pipeline_losses(sched, losses)
            loss_diffs.append(_loss_diff(values, mesh["dp"].get_group(), dp, ref_loss, ctx.device))
        pairs = [
            (p.full_tensor() if hasattr(p, "full_tensor") else p, ref.get_parameter(n))
            for n, p in stage.named_parameters()
        ]
        diffs.append(_max_diff(pairs))
    mesh_ranks = {d: dist.get_process_group_ranks(mesh[d].get_group()) for d in ("pp", "dp", "tp")}
    return {"coords": tuple(me), "diffs": diffs, "loss_diffs": loss_diffs, "step_s": times,
            "mesh_ranks": mesh_ranks, "dtensor": any(hasattr(p, "full_tensor") for p in stage.parameters())}  # fmt: skip


__all__ = [
    "DP_METHODS",
    "GPTStage",
    "batches",
    "check_shape",
    "average_gradients",
    "compose_worker",
    "make_stage",
    "stage_bounds",
    "stage_plan",
    "torch_compose_worker",
    "torch_stage_plan",
]
