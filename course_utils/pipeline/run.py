"""Launching a pipeline: checks before any process starts, then the per-rank worker (:mod:`.parity`).

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

from collections.abc import Callable

from torch import nn

from ..compat import pipelining_unsupported
from ..launcher import launch
from ..launcher.api import resolve_backend
from .parity import pipeline_worker
from .partition import check_sequential
from .schedules import RUNTIME_SCHEDULES

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
