"""course_utils.measure and the model: counts that must be exact, timers that must add up."""

from __future__ import annotations

import time

import torch
from torch import nn

from course_utils.measure import StepTimer, fmt_bytes, saved_activations, time_steps
from course_utils.models import SmallResNet, count_parameters


def test_saved_activations_counts_exact_bytes_and_skips_parameters():
    lin = nn.Linear(100, 50, bias=False)
    x = torch.randn(8, 100, requires_grad=True)
    with saved_activations() as mem:
        y = torch.relu(lin(x))  # linear saves x (input); weight is a Parameter: not counted
    # linear saves its input (8x100 floats); relu saves its output (8x50 floats)
    assert mem["bytes"] == (8 * 100 + 8 * 50) * 4
    y.sum().backward()  # unpacking still works
    assert x.grad.shape == (8, 100)


def test_step_timer_phases_and_time_steps():
    timer = StepTimer("cpu")
    for _ in range(3):
        with timer.phase("a"):
            time.sleep(0.01)
        with timer.phase("b"):
            pass
    mean = timer.mean(skip=1)
    assert set(mean) == {"a", "b"} and mean["a"] >= 0.009 and mean["b"] < mean["a"]
    calls = []
    times = time_steps(lambda: calls.append(1), steps=4, warmup=2, device="cpu")
    assert len(times) == 4 and len(calls) == 6


def test_small_resnet_shapes_and_size():
    m = SmallResNet(num_classes=10, width=8)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert SmallResNet(num_classes=10, width=8, in_channels=1)(torch.randn(2, 1, 28, 28)).shape == (
        2,
        10,
    )
    assert count_parameters(SmallResNet(width=16)) > count_parameters(m)


def test_fmt_bytes():
    assert fmt_bytes(None) == "n/a" and fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(3 * 2**30) == "3.0 GiB"
