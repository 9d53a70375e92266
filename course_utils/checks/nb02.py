"""Checks for notebook 02 (DataParallel): the scatter, and the reduce onto device 0."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..models import FrozenMLP, TiedMLP, ToyMLP, UnusedParamMLP
from .common import RefuseTorch, fail, passed

SCATTER_CASES = [(64, 4), (100, 3), (10, 4), (2, 4), (1, 3), (7, 7), (8, 3), (1000, 6), (5, 2)]


SPLITS = [
    torch.chunk,
    torch.Tensor.chunk,
    torch.split,
    torch.Tensor.split,
    torch.tensor_split,
    torch.Tensor.tensor_split,
]
SPLITTING = (
    "your function split a tensor to see the sizes (the check does that); work the sizes out "
    "from chunk's rule, with integer arithmetic"
)


def check_scatter_sizes(scatter_sizes) -> None:
    """Exercise 02.1: ``scatter_sizes(batch, k)``: the batch each replica gets from ``scatter``."""
    for batch, k in SCATTER_CASES:
        expected = [c.shape[0] for c in torch.empty(batch).chunk(k)]
        with RefuseTorch("02.1", SPLITTING, funcs=SPLITS):
            got = list(scatter_sizes(batch, k))
        if got == expected:
            continue
        where = f"a batch of {batch} on {k} devices"
        if sum(got) != batch:
            fail("02.1", f"for {where} your sizes add up to {sum(got)}, not {batch}.")
        if len(got) > len(expected) or 0 in got:
            fail(
                "02.1",
                f"for {where}: torch.chunk never makes an empty chunk, so some batches are split "
                "over fewer replicas than there are devices.",
            )
        fail(
            "02.1",
            f"for {where}: chunk does not balance the split as evenly as it could. Every chunk "
            "but the last has the same size: which one, for k chunks to cover the batch?",
        )
    passed("02.1", f"scatter sizes right for {len(SCATTER_CASES)} (batch, devices) pairs")


def _single_device_grads(model, x, y):
    reference = copy.deepcopy(model)
    nn.functional.cross_entropy(reference(x), y).backward()
    return {n: p.grad for n, p in reference.named_parameters()}


def check_reduce_gradients(reduce_gradients, k: int = 3) -> None:
    """Exercise 02.2: ``reduce_gradients(model, replicas)`` sums replica gradients onto ``model``."""
    cases = [
        ("an MLP", ToyMLP),
        ("a model with a frozen layer", FrozenMLP),
        ("a model with a layer forward never uses", UnusedParamMLP),
        ("a model that uses one layer twice", TiedMLP),
    ]
    for label, make in cases:
        torch.manual_seed(0)
        model = make().double()
        x = torch.randn(24, 16, dtype=torch.float64)
        y = torch.randint(4, (24,))
        expected = _single_device_grads(model, x, y)
        replicas = [copy.deepcopy(model) for _ in range(k)]
        outs = [r(c) for r, c in zip(replicas, x.chunk(k))]  # scatter + parallel_apply
        nn.functional.cross_entropy(torch.cat(outs), y).backward()  # gather, loss on device 0
        reduce_gradients(model, replicas)
        for name, p in model.named_parameters():
            want = expected[name]
            if want is None and p.grad is not None:
                why = (
                    "frozen parameters (requires_grad=False) get no gradient"
                    if not p.requires_grad
                    else "no replica used this parameter, so none has a gradient for it: leave "
                    ".grad as None, as one device does"
                )
                fail("02.2", f"{label}: {name} got a gradient. {why}.")
            if want is not None and p.grad is None:
                fail("02.2", f"{label}: {name} has no gradient after your reduce.")
            if want is not None and not torch.allclose(p.grad, want, rtol=1e-10, atol=1e-12):
                ratio = (p.grad.norm() / want.norm()).item()
                hint = (
                    "the loss is already a mean over the global batch: sum the replicas' "
                    "gradients, do not average them"
                    if abs(ratio * k - 1) < 1e-6
                    else "every replica's gradient must be added, each once"
                )
                fail("02.2", f"{label}: {name}'s gradient differs from one device's: {hint}.")
    passed("02.2", f"gradients equal one device's for {len(cases)} models on {k} replicas")
