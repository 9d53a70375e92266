"""Cutting a sequential model into ``p`` contiguous stages, balanced by parameters or by time."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ..measure import synchronize


def check_sequential(model: nn.Module, p: int) -> list[nn.Module]:
    """The model's layers, or a clear error when it cannot be cut into ``p`` stages."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"pipeline parallelism here cuts an nn.Sequential into stages; got {type(model).__name__}. "
            "Write the model as nn.Sequential(layer, layer, ...) (a layer may itself be any module)."
        )
    layers = list(model)
    if p > len(layers):
        raise ValueError(
            f"{p} stages but the model has only {len(layers)} layers: use at most {len(layers)} stages"
        )
    return layers


def balanced_split(costs: list[float], p: int) -> list[tuple[int, int]]:
    """Cut ``costs`` into ``p`` contiguous, non-empty ranges minimising the largest range's sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]  # best[k][j]: first j layers in k stages
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds, j = [], n
    for k in range(p, 0, -1):
        i = cut[k][j]
        bounds.append((i, j))
        j = i
    return bounds[::-1]


def param_costs(layers: list[nn.Module]) -> list[float]:
    return [float(sum(q.numel() for q in layer.parameters())) for layer in layers]


def time_costs(layers: list[nn.Module], sample: torch.Tensor, rounds: int = 21) -> list[float]:
    """Measured forward + backward seconds of each layer on ``sample`` (one micro-batch): the
    median over ``rounds`` rounds, each timing every layer once in turn, so that a busy spell of
    the machine slows every layer alike instead of one.

    GPU kernels run asynchronously, so the clock is read only after a synchronize. The layers'
    gradients and buffers (BatchNorm's running statistics) are left as they were.
    """
    params = [q for layer in layers for q in layer.parameters()]
    saved = [q.grad for q in params]
    for q in params:  # backward would accumulate into the existing tensors in place
        q.grad = None
    buffers = [b for layer in layers for b in layer.buffers()]
    saved_buffers = [b.detach().clone() for b in buffers]
    try:
        inputs, x = [], sample
        with torch.no_grad():  # each layer's input: the previous layer's output
            for layer in layers:
                inputs.append(x)
                x = layer(x)
        times = [[] for _ in layers]
        for _ in range(rounds):
            for i, layer in enumerate(layers):
                inp = inputs[i].detach().requires_grad_()
                synchronize(sample.device)
                t0 = time.perf_counter()
                out = layer(inp)
                out.backward(torch.ones_like(out))
                synchronize(sample.device)
                times[i].append(time.perf_counter() - t0)
        return [statistics.median(t) for t in times]
    finally:
        for q, g in zip(params, saved):
            q.grad = g
        with torch.no_grad():
            for b, v in zip(buffers, saved_buffers):
                b.copy_(v)


def partition(model: nn.Sequential, p: int, by: str = "params", sample: torch.Tensor | None = None):
    """``[(start, end), ...]`` layer ranges of the ``p`` stages."""
    layers = check_sequential(model, p)
    if by == "params":
        return balanced_split(param_costs(layers), p)
    if by == "time":
        if sample is None:
            raise ValueError("by='time' needs a sample micro-batch to time the layers on")
        return balanced_split(time_costs(layers, sample), p)
    raise ValueError(f"by must be 'params' or 'time', got {by!r}")


def boundary_shapes(model: nn.Sequential, bounds, sample: torch.Tensor) -> list[torch.Size]:
    """Shape of the activation leaving each stage for one micro-batch like ``sample``."""
    shapes, x = [], sample
    with torch.no_grad():
        for a, b in bounds:
            for layer in list(model)[a:b]:
                x = layer(x)
            shapes.append(x.shape)
    return shapes
