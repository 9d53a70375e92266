"""Every way to shard data-parallel training, checked against one process.

:func:`parity_worker` (run it under ``launch``) trains a model with one of
:data:`~.run.METHODS` on this rank's slice of each global batch, and beside it a single-process
reference on the whole batch (:func:`course_utils.parity.train_beside_reference`). It returns,
per step, the largest parameter difference, and at the end the model-state bytes this rank held
(:func:`~.memory.count_model_states`) and the bytes it sent per step (:mod:`.traffic`; for the
course's own stages).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parity import global_batches, train_beside_reference
from . import traffic
from .memory import count_model_states
from .run import MODELS, OPTIMIZERS, wrap


def parity_worker(
    ctx,
    method: str,
    model: str = "mlp",
    optimizer: str = "adam",
    steps: int = 3,
    global_batch: int = 16,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> dict:
    """Train with ``method`` and, beside it, one process on the whole batch; see the module doc."""
    n, r = dist.get_world_size(), dist.get_rank()
    cls, options = OPTIMIZERS[optimizer]
    wrapped = {}

    def parallelize(net):
        call, opt, wrapped["full"] = wrap(method, net, optimizer, ctx.device)
        return call, opt

    def train_step(call, opt, shard):
        with traffic.recording() as log:
            loss = nn.functional.cross_entropy(call(shard[0]), shard[1])
            loss.backward()
            getattr(call, "finish_gradient_synchronization", lambda: None)()
            opt.step()
        states = count_model_states(call, opt)
        opt.zero_grad()
        return loss, log.volume_bytes, states

    def local_view(call, reference):
        mine = wrapped["full"]()
        return ((mine[k], p) for k, p in reference.named_parameters())

    run = train_beside_reference(
        lambda: MODELS[model]().to(ctx.device, dtype),
        parallelize,
        local_view,
        global_batches(steps, global_batch, 16, 4, dtype, ctx.device, seed + 1),
        train_step,
        shard=lambda batch: tuple(t.chunk(n)[r] for t in batch),
        reference_optimizer=lambda params: cls(params, **options),
        seed=seed,
    )
    loss, sent, states = run.outputs[-1]
    psi = sum(p.numel() for p in run.reference.parameters() if p.requires_grad)
    return {
        "loss": float(loss),
        "diffs": run.diffs,
        "volume_per_psi": sent / (psi * torch.finfo(dtype).bits // 8),
        "states": {k: states.bytes(k) for k in ("parameters", "gradients", "optimizer")},
        "psi": psi,
    }


def parity_many(ctx, method: str, cases, steps: int = 3) -> list[dict]:
    """:func:`parity_worker` for each ``(model, optimizer, dtype)`` of ``cases``, in one launch."""
    return [
        parity_worker(ctx, method, model=m, optimizer=o, dtype=d, steps=steps) for m, o, d in cases
    ]
