"""The course's own 3D composition trained beside one process: :func:`compose_worker`.

Every rank trains its TP shard of its pipeline stage on its DP replica's slice of each batch and,
beside it (:func:`course_utils.parity.train_beside_reference`), one single-process copy of the
model on the whole batch; after every step each parameter shard is compared with the same slice
of the copy.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.nn import functional as F

from ..modelled import describe
from ..models import GPT, GPTConfig
from ..parity import train_beside_reference
from ..tensor_parallel.run import shard_like
from .dims import ParallelDims
from .stages import batches, check_shape
from .step import DP_METHODS, course_groups, course_stage, course_step, loss_diff, stage_runner


def gpt_reference_loss(ref, batch) -> float:
    """The single-process reference's step on the whole batch: next-token cross-entropy, backward."""
    x, y = batch
    loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item()


def loss_diffs(run, group, dp: int, device) -> list[float]:
    """Per step, |the DP replicas' mean loss - the reference's| (the last stage's numbers)."""
    return [loss_diff(out["losses"], group, dp, ref, device)
            for out, ref in zip(run.outputs, run.reference_losses)]  # fmt: skip


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

    check_compose_args(dp_method, compute, reference)
    cfg = cfg or GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    dims = ParallelDims(dp, pp, tp, world_size=ctx.world_size)
    check_shape(dims, cfg, global_batch, micro_batches)
    groups = course_groups(dims, build_groups)
    micro = global_batch // dp // micro_batches

    def parallelize(full):
        stage, params, opt = course_stage(full, groups, dp_method, lr)
        runner = stage_runner(stage, groups, cfg, micro, dtype, ctx.device)
        return SimpleNamespace(stage=stage, params=params, runner=runner), opt

    def local_view(parallel, ref):
        return [(p, shard_like(ref.get_parameter(n), p, groups.tp))
                for n, p in parallel.stage.named_parameters()]  # fmt: skip

    def step(parallel, opt, batch):
        return course_step(ctx, parallel, opt, groups, batch, schedule, dp_method, micro_batches,
                           compute)  # fmt: skip

    run = train_beside_reference(
        lambda: GPT(cfg).to(ctx.device, dtype),
        parallelize,
        local_view,
        batches(cfg, global_batch, steps, seed, ctx.device),
        step,
        reference_loss=gpt_reference_loss,
        reference_optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        reference=reference,
        reference_first=False,
        seed=seed,
    )
    return compose_result(ctx, run, groups, compute)


def check_compose_args(dp_method: str, compute, reference: bool) -> None:
    """Refuse an unknown DP method, and modelled compute with a reference to compare."""
    if dp_method not in DP_METHODS:
        raise ValueError(f"dp_method must be one of {DP_METHODS}, not {dp_method!r}")
    if compute is not None and reference:
        raise ValueError(
            "modelled compute returns zeros for every product: pass reference=False (check "
            "parity in a run without compute=...)"
        )


def compose_result(ctx, run, groups, compute) -> dict:
    """:func:`compose_worker`'s report: coordinates, parity per step, times, bytes held."""
    stage, runner = run.model.stage, run.model.runner
    return {
        "coords": tuple(groups.coords), "ranks": groups.ranks, "blocks": list(stage.blocks.keys()),
        "diffs": run.diffs,
        "loss_diffs": loss_diffs(run, groups.dp, groups.dims.dp, ctx.device) if stage.last else [],
        "step_s": [o["step_s"] for o in run.outputs], "cpu_s": [o["cpu_s"] for o in run.outputs],
        "params": sum(p.numel() for p in stage.parameters()),
        "states_bytes": run.outputs[-1]["states"].total,
        "peak_activation_bytes": runner.peak_held_bytes,
        "micro_activation_bytes": max(runner.micro_bytes), "backend": ctx.backend,
        "modelled": describe(compute, ctx.backend) if compute is not None else None,
    }  # fmt: skip
