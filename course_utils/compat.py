"""The torch versions the course supports, and the few APIs that moved between them.

The floor is the oldest torch the course is tested with: CI runs the non-notebook tests on it
(``make test-floor``). It is 2.6 because the course uses, as public APIs: ``torch.distributed.tensor``
(DTensor, public since 2.5), ``torch.distributed.fsdp.fully_shard`` (FSDP2, public in 2.6),
``torch.distributed.pipelining`` (2.4) and the profiler's ``distributedInfo`` trace field.
What differs between the floor and the tested version, and is bridged here:

* :func:`pipeline_schedule`: ``scale_grads`` of the pipelining schedules (absent in 2.6);
* :func:`pipelining_unsupported`: 2.6's 1F1B schedules hang on gloo;
* :func:`fsdp2_unsupported`: 2.6's FSDP2 runs on accelerators only (its CPU stream lacks events);
* :func:`tensor_factories`: a private list of tensor factories (``COURSE_CHECK_DEVICES``).

Code elsewhere in the package imports a moved API from here, never by version checks of its own.
"""

from __future__ import annotations

import re

FLOOR = "2.6"  # scripts/setup_env.py FLOOR_PINS and pyproject's torch>= say the same (tested)
TESTED = "2.14.1"  # requirements.txt


def version_tuple(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def older_than_floor(v: str) -> bool:
    return version_tuple(v) < version_tuple(FLOOR)


def tensor_factories() -> set:
    """Every tensor factory that takes ``device=`` (what ``torch.set_default_device`` redirects).

    torch keeps the list in a private helper, ``torch.utils._device._device_constructors``
    (present from 2.0 through 2.14); if a release moves it, the common factories still count.
    """
    import torch

    try:
        from torch.utils._device import _device_constructors

        return set(_device_constructors())
    except ImportError:  # pragma: no cover - a torch that moved the private helper
        common = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn}
        return common | {torch.randint, torch.arange, torch.tensor, torch.as_tensor, torch.eye}


def pipeline_schedule(cls, stages, n_microbatches: int, loss_fn):
    """``cls(stages, n_microbatches, loss_fn)``, a ``torch.distributed.pipelining`` schedule whose
    gradients are those of the mean loss over the whole batch, on every supported torch.

    Releases after 2.6 divide the gradients accumulated over the ``m`` micro-batches by ``m``
    (``scale_grads=True``, their default). torch 2.6 has no such argument and leaves them summed,
    ``m`` times too large: there the loss function itself is divided by ``m``. The losses a schedule
    hands back are then ``1/m`` of the micro-batch losses; :func:`pipeline_losses` undoes that.
    """
    import inspect

    if "scale_grads" in inspect.signature(cls.__init__).parameters:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    sched = cls(stages, n_microbatches=n_microbatches, loss_fn=_Scaled(loss_fn, n_microbatches))
    sched._course_loss_scale = n_microbatches
    return sched


class _Scaled:
    def __init__(self, loss_fn, m: int):
        self.loss_fn, self.m = loss_fn, m

    def __call__(self, output, target):
        return self.loss_fn(output, target) / self.m


def pipelining_unsupported(schedule: str, backend: str) -> str | None:
    """Why ``torch.distributed.pipelining``'s ``schedule`` cannot run on ``backend`` with this
    torch, or None. ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.

    torch 2.6's Schedule1F1B and ScheduleInterleaved1F1B hang on gloo: they fuse a send and a
    receive in one ``batch_isend_irecv`` and wait on its last request only (seen here with 2 CPU
    ranks; pytorch issue 132644). Their ScheduleGPipe works, and torch 2.14.1 runs all three.
    """
    import torch

    if backend == "gloo" and schedule != "gpipe" and version_tuple(torch.__version__) <= (2, 6):
        return (
            f"torch {torch.__version__}'s {schedule} schedule of torch.distributed.pipelining hangs "
            "on gloo (CPU ranks); its GPipe works. Use the course's own schedule (run_pipeline "
            "with '1f1b'), or torch 2.14.1 (make setup)."
        )
    return None


def fsdp2_unsupported(device_type: str) -> str | None:
    """Why FSDP2's ``fully_shard`` cannot run on ``device_type`` with this torch, or None.

    FSDP2 records events on its all-gather and reduce-scatter streams. torch 2.6's CPU stream has
    no ``record_event``/``wait_event`` (they became no-ops in 2.7, pytorch PR 145935), so a CPU
    model wrapped by ``fully_shard`` fails at its first forward with "'Stream' object has no
    attribute 'record_event'". On GPUs it works from 2.6.
    """
    import torch

    if device_type == "cpu" and version_tuple(torch.__version__) < (2, 7):
        return (
            f"FSDP2 (fully_shard) runs on CPU ranks from torch 2.7; this is torch "
            f"{torch.__version__}, whose CPU stream has no events. Run it on GPUs, use the "
            "course's ShardedModel (ZeRO-3), or torch 2.14.1 (make setup)."
        )
    return None


def pipeline_losses(sched, losses: list) -> list[float]:
    """The micro-batch losses a schedule from :func:`pipeline_schedule` returned, as floats."""
    scale = getattr(sched, "_course_loss_scale", 1)
    return [loss.item() * scale for loss in losses]


__all__ = [
    "FLOOR",
    "TESTED",
    "version_tuple",
    "older_than_floor",
    "tensor_factories",
    "pipeline_schedule",
    "pipeline_losses",
    "pipelining_unsupported",
    "fsdp2_unsupported",
]
