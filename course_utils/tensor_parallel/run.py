"""Tensor-parallel training checked against one process, from scratch and with torch's DTensor TP.

Each rank builds the same single-device model and a copy of it, shards the copy (with
:func:`apply_tp`, or torch's ``parallelize_module``), trains both on the same batches, and
compares: the forward output, the loss, the input's gradient, every parameter's gradient (this
rank's shard against the same slice of the full gradient), and every parameter after ``steps``
optimizer steps. Shards are contiguous and in rank order, so "the same slice" is found from the
shapes alone (:func:`shard_like`).

    from course_utils import launch
    from course_utils.tensor_parallel.run import gpt_parity
    res = launch(gpt_parity, world_size=2)       # from scratch, float64
    res.results[0]["params"]                      # max |difference| after the steps
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..measure import max_abs_diff
from ..models import GPT, GPTConfig
from .apply import apply_tp, gpt_plan
from .loss import vocab_parallel_cross_entropy


def shard_like(full: torch.Tensor, local: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` with ``local``'s shape (``full`` if they agree)."""
    if full.shape == local.shape:
        return full
    dims = [d for d, (a, b) in enumerate(zip(full.shape, local.shape)) if a != b]
    if len(dims) != 1 or full.dim() != local.dim():
        raise ValueError(f"cannot find {tuple(local.shape)} as a slice of {tuple(full.shape)}")
    d = dims[0]
    n = full.shape[d] // local.shape[d]
    return full.chunk(n, d)[dist.get_rank(group) % n]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard, or the tensor


def _grad_local(p) -> torch.Tensor:
    """This rank's gradient shard. A DTensor parameter run on sequence shards (a LayerNorm under
    ``SequenceParallel``) holds a pending sum (``Partial``): DTensor reduces it when asked."""
    g = p.grad
    if hasattr(g, "redistribute"):
        g = g.redistribute(g.device_mesh, p.placements)
    return _local(g)


def settle_partial_grads(model) -> None:
    """Sum the pending (``Partial``) gradients of DTensor parameters before the optimizer step.

    A LayerNorm under ``SequenceParallel`` sees only this rank's positions, so its weight's
    gradient is a DTensor with a pending sum over the ranks. torch 2.14's optimizers sum it when
    they combine it with the replicated weight; torch 2.6's SGD applied each rank's partial sum, and
    the ranks' copies drifted apart (seen in this course's floor test). Doing it here is right on
    both.
    """
    for p in model.parameters():
        g = p.grad
        if hasattr(g, "redistribute") and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def _max_diff(pairs) -> float:
    return max_abs_diff(pairs)  # NaN if any difference is NaN


def _loss(out, ref_out, y, kind: str, group):
    """The loss on this rank and on the reference. ``out`` may be sharded (by vocabulary for
    ``ce``, by sequence for ``mse``); the reference sees the whole."""
    if kind == "ce":
        ref = F.cross_entropy(ref_out.flatten(0, -2), y.flatten())
        if hasattr(out, "to_local"):  # a DTensor: torch's loss_parallel does the sharded loss
            return F.cross_entropy(out.flatten(0, -2), y.flatten()), ref, out
        if _local(out).shape[-1] < ref_out.shape[-1]:
            return vocab_parallel_cross_entropy(out, y, group), ref, out
        return F.cross_entropy(out.flatten(0, -2), y.flatten()), ref, out
    # a sum-of-squares loss scaled by the full size: its pieces on sequence shards add up
    scale = 1.0 / ref_out.numel()
    ref = ((ref_out - y) ** 2).sum() * scale
    mine = ((out - shard_like(y, out, group)) ** 2).sum() * scale
    return mine, ref, out


def parity_worker(
    ctx,
    make_model,
    make_batch,
    parallelize,
    loss: str = "mse",
    steps: int = 3,
    lr: float = 0.05,
    dtype=torch.float64,
    group=None,
) -> dict:
    """Train ``parallelize(copy of make_model())`` and ``make_model()`` side by side.

    ``make_batch(generator, dtype, device) -> (x, y)``; ``parallelize(model) -> model`` shards in
    place (``lambda m: apply_tp(m, plan)``). Returns the largest absolute differences:
    ``{"out", "loss", "input_grad", "grads", "params"}`` (first step for the first four, after
    ``steps`` steps for the last), and ``"shapes"``: every parameter's local shape and type.
    """
    torch.manual_seed(0)
    reference = make_model().to(ctx.device, dtype)
    model = parallelize(copy.deepcopy(reference))
    shapes = {n: (type(p).__name__, tuple(_local(p).shape)) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    diffs = {"out": 0.0, "loss": 0.0, "input_grad": 0.0, "grads": 0.0}
    losses = []
    for step in range(steps):
        x, y = make_batch(gen, dtype, ctx.device)
        xr = x.clone().requires_grad_(x.is_floating_point())
        xm = x.clone().requires_grad_(x.is_floating_point())
        ref_out = reference(xr)
        out = model(xm)
        with _loss_context(out):
            mine, ref, out = _loss(out, ref_out, y, loss, group)
            opt.zero_grad()
            opt_ref.zero_grad()
            mine.backward()
        ref.backward()
        total = mine.detach().clone()
        if _local(out).shape[1:2] != ref_out.shape[1:2] and loss == "mse":  # sequence shards
            dist.all_reduce(total, group=group)
        losses.append(float(_local(total)))
        if step == 0:
            diffs["out"] = _max_diff([(_local(out), shard_like(ref_out, _local(out), group))])
            diffs["loss"] = abs(float(_local(total)) - float(ref))
            if xm.grad is not None:
                diffs["input_grad"] = _max_diff([(xm.grad, xr.grad)])
            pairs = []
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                if (p.grad is None) != (q.grad is None):
                    raise AssertionError(f"{name}: gradient present on one side only")
                if p.grad is not None:
                    g = _grad_local(p)
                    pairs.append((g, shard_like(q.grad, g, group)))
            diffs["grads"] = _max_diff(pairs)
        settle_partial_grads(model)
        opt.step()
        opt_ref.step()
    params = [
        (_local(p.detach()), shard_like(q.detach(), _local(p.detach()), group))
        for p, q in zip(model.parameters(), reference.parameters())
    ]
    diffs["params"] = _max_diff(params)
    return {**diffs, "losses": losses, "shapes": shapes}


def _loss_context(out):
    """torch's ``loss_parallel`` around the loss and backward when the logits are a DTensor."""
    import contextlib

    if hasattr(out, "to_local"):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def token_batch(cfg: GPTConfig, batch: int = 4):
    """``make_batch`` for :class:`GPT`: random token ids and next-token-like targets."""

    def make(gen, dtype, device):
        x = torch.randint(cfg.vocab, (batch, cfg.seq_len), generator=gen)
        y = torch.randint(cfg.vocab, (batch, cfg.seq_len), generator=gen)
        return x.to(device), y.to(device)

    return make


def hidden_batch(cfg: GPTConfig, batch: int = 4):
    """``make_batch`` for a layer on hidden states: ``(B, T, h)`` inputs and targets."""

    def make(gen, dtype, device):
        shape = (batch, cfg.seq_len, cfg.d_model)
        x = torch.randn(shape, generator=gen, dtype=dtype)
        return x.to(device), torch.randn(shape, generator=gen, dtype=dtype).to(device)

    return make


def torch_gpt_plan(model: GPT, sequence_parallel: bool = False) -> dict:
    """:func:`gpt_plan` in torch's ``torch.distributed.tensor.parallel`` styles, as torchtitan
    writes it: same shards, DTensor placements instead of hand-written collectives."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {"embed": RowwiseParallel(input_layouts=Replicate())}  # vocab-parallel embedding
    if not sequence_parallel:
        for i in range(len(model.blocks)):
            plan |= {
                f"blocks.{i}.attn.qkv": ColwiseParallel(),
                f"blocks.{i}.attn.proj": RowwiseParallel(),
                f"blocks.{i}.mlp.up": ColwiseParallel(),
                f"blocks.{i}.mlp.down": RowwiseParallel(),
            }
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return plan
    plan["blocks.0"] = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.ln1": SequenceParallel(),
            f"blocks.{i}.attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.ln2": SequenceParallel(),
            f"blocks.{i}.mlp.up": ColwiseParallel(input_layouts=Shard(1)),
            f"blocks.{i}.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    plan["ln_f"] = SequenceParallel()
    plan["head"] = ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    )
    return plan


def torch_tp(model: GPT, sequence_parallel: bool = False, device=None):
    """Shard ``model`` with torch's ``parallelize_module`` on a 1-D mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    device = torch.device(device or next(model.parameters()).device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, torch_gpt_plan(model, sequence_parallel))


def gpt_parity(
    ctx,
    cfg: GPTConfig | None = None,
    sequence_parallel: bool = False,
    impl: str = "scratch",
    steps: int = 3,
    batch: int = 4,
) -> dict:
    """:func:`parity_worker` on :class:`GPT`: ``impl`` is ``"scratch"`` (:func:`apply_tp`) or
    ``"torch"`` (``parallelize_module`` with ``loss_parallel``)."""
    cfg = cfg or GPTConfig()
    if impl == "scratch":
        plan = gpt_plan(sequence_parallel)

        def parallelize(m):
            return apply_tp(m, plan)
    elif impl == "torch":

        def parallelize(m):
            return torch_tp(m, sequence_parallel, ctx.device)
    else:
        raise ValueError(f"impl must be 'scratch' or 'torch', got {impl!r}")
    return parity_worker(
        ctx, lambda: GPT(cfg), token_batch(cfg, batch), parallelize, loss="ce", steps=steps
    )


__all__ = [
    "gpt_parity",
    "hidden_batch",
    "parity_worker",
    "settle_partial_grads",
    "shard_like",
    "token_batch",
    "torch_gpt_plan",
    "torch_tp",
]
