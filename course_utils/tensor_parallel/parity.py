"""Tensor-parallel training checked against one process, from scratch and with torch's DTensor TP.

Each rank builds the same single-device model and a copy of it, shards the copy (with
:func:`~.apply.apply_tp`, or torch's ``parallelize_module``), trains both on the same batches
(:func:`course_utils.parity.train_beside_reference`), and compares: the forward output, the loss,
the input's gradient, every parameter's gradient (this rank's shard against the same slice of the
full gradient), and every parameter after ``steps`` optimizer steps. Shards are contiguous and in
rank order, so "the same slice" is found from the shapes alone (:func:`~.run.shard_like`).

    from course_utils import launch
    from course_utils.tensor_parallel.parity import gpt_parity
    res = launch(gpt_parity, world_size=2)       # from scratch, float64
    res.results[0]["params"]                      # max |difference| after the steps
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..measure import max_abs_diff
from ..models import GPT, GPTConfig
from ..parity import train_beside_reference
from .apply import apply_tp, gpt_plan
from .loss import vocab_parallel_cross_entropy
from .run import _grad_local, _local, settle_partial_grads, shard_like, torch_tp


def _max_diff(pairs) -> float:
    return max_abs_diff(pairs)  # NaN if any difference is NaN


def _reference_loss(ref_out, y, kind: str):
    """The single-device model's loss on the whole output."""
    if kind == "ce":
        return F.cross_entropy(ref_out.flatten(0, -2), y.flatten())
    return ((ref_out - y) ** 2).sum() * (1.0 / ref_out.numel())


def _loss(out, ref_out, y, kind: str, group):
    """The loss on this rank. ``out`` may be sharded (by vocabulary for ``ce``, by sequence for
    ``mse``); the reference's ``ref_out`` is whole."""
    if kind == "ce":
        if hasattr(out, "to_local"):  # a DTensor: torch's loss_parallel does the sharded loss
            return F.cross_entropy(out.flatten(0, -2), y.flatten())
        if _local(out).shape[-1] < ref_out.shape[-1]:
            return vocab_parallel_cross_entropy(out, y, group)
        return F.cross_entropy(out.flatten(0, -2), y.flatten())
    # a sum-of-squares loss scaled by the full size: its pieces on sequence shards add up
    scale = 1.0 / ref_out.numel()
    return ((out - shard_like(y, out, group)) ** 2).sum() * scale


def _loss_context(out):
    """torch's ``loss_parallel`` around the loss and backward when the logits are a DTensor."""
    import contextlib

    if hasattr(out, "to_local"):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _first_step_diffs(model, reference, out, ref_out, xm, xr, total, ref, group) -> dict:
    """The first step's differences: output, loss, input gradient, every parameter gradient."""
    diffs = {"out": _max_diff([(_local(out), shard_like(ref_out, _local(out), group))])}
    diffs["loss"] = abs(float(_local(total)) - float(ref))
    diffs["input_grad"] = _max_diff([(xm.grad, xr.grad)]) if xm.grad is not None else 0.0
    pairs = []
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"{name}: gradient present on one side only")
        if p.grad is not None:
            g = _grad_local(p)
            pairs.append((g, shard_like(q.grad, g, group)))
    diffs["grads"] = _max_diff(pairs)
    return diffs


def _batches(make_batch, steps: int, dtype, device):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        yield make_batch(gen, dtype, device)


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
    seen = {"step": 0}  # the reference's output and input of this step, for the first's checks
    diffs = {"out": 0.0, "loss": 0.0, "input_grad": 0.0, "grads": 0.0}

    def shard(model):
        model = parallelize(model)
        seen["shapes"] = {n: (type(p).__name__, tuple(_local(p).shape))
                          for n, p in model.named_parameters()}  # fmt: skip
        return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def reference_loss(reference, batch):
        x, y = batch
        seen["reference"] = reference
        seen["xr"] = xr = x.clone().requires_grad_(x.is_floating_point())
        seen["ref_out"] = reference(xr)
        seen["ref"] = ref = _reference_loss(seen["ref_out"], y, loss)
        ref.backward()
        return float(ref)

    def train_step(model, opt, batch):
        x, y = batch
        xm = x.clone().requires_grad_(x.is_floating_point())
        ref_out = seen["ref_out"]
        out = model(xm)
        with _loss_context(out):
            mine = _loss(out, ref_out, y, loss, group)
            opt.zero_grad()
            mine.backward()
        total = mine.detach().clone()
        if _local(out).shape[1:2] != ref_out.shape[1:2] and loss == "mse":  # sequence shards
            dist.all_reduce(total, group=group)
        if seen["step"] == 0:
            diffs.update(_first_step_diffs(model, seen["reference"], out, ref_out, xm, seen["xr"], total,
                                           seen["ref"], group))  # fmt: skip
        seen["step"] += 1
        settle_partial_grads(model)
        opt.step()
        return float(_local(total))

    def local_view(model, ref):
        for p, q in zip(model.parameters(), ref.parameters()):
            mine = _local(p.detach())
            yield mine, shard_like(q.detach(), mine, group)

    run = train_beside_reference(
        lambda: make_model().to(ctx.device, dtype),
        shard,
        local_view,
        _batches(make_batch, steps, dtype, ctx.device),
        train_step,
        reference_loss=reference_loss,
        reference_optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
    )
    diffs["params"] = run.diffs[-1]
    return {**diffs, "losses": run.outputs, "shapes": seen["shapes"]}


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


__all__ = ["gpt_parity", "hidden_batch", "parity_worker", "token_batch"]
