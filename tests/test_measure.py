"""course_utils.measure and the model: counts that must be exact, timers that must add up."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from course_utils.measure import (
    StepTimer,
    Timing,
    compare,
    fmt_bytes,
    max_abs_diff,
    saved_activations,
    time_steps,
    verdict,
    worst,
)
from course_utils.models import SmallResNet, count_parameters

# make test-floor runs these on the oldest torch too: saved_tensors_hooks
pytestmark = [pytest.mark.floor]


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


def test_timing_quartiles_and_spread_on_known_samples():
    odd = Timing((5.0, 1.0, 3.0, 2.0, 4.0))  # any order: sorted 1..5
    assert (odd.median, odd.q1, odd.q3) == (3.0, 2.0, 4.0)
    assert odd.spread == pytest.approx(2 / 3) and odd.rate(12) == pytest.approx(4.0)
    even = Timing((0.4, 0.1, 0.3, 0.2))  # linear interpolation between the sorted samples
    assert even.median == pytest.approx(0.25)
    assert even.q1 == pytest.approx(0.175) and even.q3 == pytest.approx(0.325)
    assert str(even) == "250.0 ms [175.0, 325.0] (median [quartiles] of 4)"


def test_verdict_concludes_only_where_the_quartiles_do_not_overlap():
    slow, fast = Timing((10, 11, 12, 13, 14)), Timing((5, 6, 7, 8, 9))
    assert verdict(fast, slow) == "faster" and verdict(slow, fast) == "slower"
    near = Timing((8.5, 9.5, 10.5, 11.5, 12.5))  # its q3 11.5 is above slow's q1 11
    assert verdict(near, slow) == verdict(slow, near) == "no clear difference"
    touching = Timing((9, 9.5, 11, 11.5, 12))  # q3 11.5 > slow's q1 11: still overlapping
    assert verdict(touching, slow) == "no clear difference"
    assert verdict(slow, slow) == "no clear difference"


def test_compare_interleaves_the_versions_round_by_round():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    out = compare(steps, rounds=2, per_round=3, warmup=1, device="cpu")
    assert calls == ["a", "b"] + ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert {k: len(t.samples) for k, t in out.items()} == {"a": 6, "b": 6}
    assert all(isinstance(t, Timing) for t in out.values())


def test_worst_and_max_abs_diff_keep_a_nan_wherever_it_comes():
    nan = float("nan")
    assert worst([]) == 0.0 and worst([1e-13, 3e-13, 2e-13]) == 3e-13
    for values in ([nan, 0.0], [0.0, nan], [0.0, 1e-14, nan]):  # Python's max keeps only a first
        assert worst(values) != worst(values)
    a, b = torch.zeros(3), torch.tensor([0.0, 1e-3, -2e-3])
    assert max_abs_diff([(a, b), (a, a)]) == pytest.approx(2e-3)
    assert max_abs_diff([(a, a), (a, torch.tensor([0.0, nan, 0.0]))]) != 0.0  # NaN, not 0
    assert not max_abs_diff([(a, a), (a, torch.tensor([nan, 0.0, 0.0]))]) <= 1e-12
