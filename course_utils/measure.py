"""Measuring a training step: phase timers, activation memory, throughput.

The notebooks write the training step; these helpers only time and count it,
the same way on CPU and GPU. Taught first in notebook 01.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work; a no-op on CPU (CPU ops run eagerly)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Seconds spent per phase of a step.

    CUDA kernels run asynchronously: without a synchronize, time lands in
    whichever later phase happens to wait. Each phase therefore synchronizes
    at its start and end, which is right for a breakdown but slows the step
    a little; measure throughput without it (:func:`time_steps`).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.times: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def phase(self, name: str):
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.times[name].append(time.perf_counter() - t0)

    def mean(self, skip: int = 0) -> dict[str, float]:
        """Mean seconds per phase, leaving out the first ``skip`` (warm-up) steps."""
        return {k: statistics.fmean(v[skip:] or v) for k, v in self.times.items()}


@contextlib.contextmanager
def saved_activations():
    """Count the bytes autograd keeps for backward (activations), parameters excluded.

    ``with saved_activations() as mem: loss = model(x).sum()`` then
    ``mem["bytes"]``. Storage shared by several saved tensors is counted once.
    The count is the same on CPU and GPU, unlike allocator statistics.
    """
    seen: set[int] = set()
    box = {"bytes": 0, "tensors": 0}

    def pack(t: torch.Tensor):
        base = t if t._base is None else t._base  # linear saves weight.t(), a view of the Parameter
        if not isinstance(base, nn.Parameter):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                box["bytes"] += storage.nbytes()
                box["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield box


def loopback_bytes() -> int | None:
    """Bytes this machine has sent over its loopback interface so far (Linux's ``/proc/net/dev``),
    or None where there is no such counter. CPU ranks on one node talk over loopback, so the
    difference around a step is what really travelled (other programs can only add to it).
    Used in notebooks 03 and 06."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                if line.strip().startswith("lo:"):
                    return int(line.split()[9])  # transmitted bytes
    except OSError:
        pass
    return None


def time_steps(
    step: Callable[[], object], steps: int, warmup: int, device: torch.device | str
) -> list[float]:
    """Run ``step()`` ``warmup`` times untimed, then time ``steps`` calls one by one (seconds each)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class Timing:
    """Seconds per call over many timed calls: the median and the spread around it."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def q1(self) -> float:
        """25th percentile: a quarter of the calls were faster."""
        return _quantile(self.samples, 0.25)

    @property
    def q3(self) -> float:
        """75th percentile: a quarter of the calls were slower."""
        return _quantile(self.samples, 0.75)

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median: 0.1 means the middle half of the calls lay
        within a band 10% of the median wide."""
        return (self.q3 - self.q1) / self.median

    def rate(self, items: float) -> float:
        """Items (images, tokens) per second at the median."""
        return items / self.median

    def __str__(self) -> str:
        return (
            f"{self.median * 1e3:.1f} ms [{self.q1 * 1e3:.1f}, {self.q3 * 1e3:.1f}] "
            f"(median [quartiles] of {len(self.samples)})"
        )


def worst(values) -> float:
    """The largest of ``values`` (0.0 for none), and NaN if any is NaN: Python's ``max`` keeps a
    NaN only when it comes first, so a parity check built on it would pass a result that is NaN
    everywhere but its first entry. Compare the result as ``not worst(...) <= tol``."""
    out = 0.0
    for v in values:
        v = float(v)
        if v != v:
            return float("nan")
        out = max(out, v)
    return out


def max_abs_diff(pairs) -> float:
    """``worst`` of ``|a - b|`` over the ``(a, b)`` tensor pairs: NaN when either holds a NaN."""
    return worst(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def verdict(a: Timing, b: Timing) -> str:
    """``"faster"``, ``"slower"`` or ``"no clear difference"``: ``a`` against ``b``, called faster
    only when every quartile of ``a`` lies below ``b``'s (its 75th percentile under ``b``'s 25th),
    slower the other way round; overlapping middles conclude nothing."""
    if a.q3 < b.q1:
        return "faster"
    if a.q1 > b.q3:
        return "slower"
    return "no clear difference"


def _quantile(xs, q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def compare(
    steps: dict[str, Callable[[], object]],
    rounds: int,
    per_round: int,
    warmup: int,
    device: torch.device | str,
) -> dict[str, Timing]:
    """Time several versions of a step side by side, interleaved: ``rounds`` times, each version in
    turn runs ``per_round`` timed calls (after ``warmup`` untimed ones, once). A busy neighbour or a
    clock that changes speed then slows every version alike, and the ratios of their medians hold
    where single back-to-back runs would not. Returns a :class:`Timing` per version."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name] += time_steps(step, per_round, 0, device)
    return {name: Timing(tuple(v)) for name, v in samples.items()}


def peak_memory(device: torch.device | str) -> int | None:
    """Peak bytes allocated by tensors on a CUDA device since the last reset; None on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def allocated_memory(device: torch.device | str) -> int | None:
    """Bytes the CUDA caching allocator has handed out on ``device`` now
    (``torch.cuda.memory_allocated``: tensors' blocks rounded up to 512 bytes, plus the cuBLAS
    workspace it keeps after the first matrix product; cuDNN's workspaces are freed after each
    call); None on CPU. Notebooks 01, 06 and 08 print it beside the counted formula."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return None


def reset_peak_memory(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def storage_bytes(tensors) -> dict[torch.dtype, int]:
    """Bytes of the storage behind ``tensors``, by dtype, each storage counted once.

    Views of one flat buffer (ZeRO's buckets) count the whole buffer once, padding included;
    a storage resized to nothing (a freed ZeRO-3 unit) counts zero. Counted from the tensors
    themselves, so CPU and GPU give the same numbers (notebook 08)."""
    seen: set[tuple[str, int]] = set()
    out: dict[torch.dtype, int] = defaultdict(int)
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out[t.dtype] += storage.nbytes()
    return dict(out)


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; ``None`` -> ``'n/a'``."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
