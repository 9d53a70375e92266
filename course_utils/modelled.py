"""Modelled compute: real processes, schedule and communication; compute time from a model.

On a CPU node, several ranks share a few cores. Effects that need ranks to compute *at the same
time* (a pipeline's bubble, communication hidden behind backward, a straggler's cost, tensor
parallelism's share of communication, scaling) cannot show there: two ranks computing at once on
two loaded cores each run at half speed, so nothing overlaps. Inside :class:`ModelledCompute`, a
rank's heavy compute does not burn a core; it takes the time it would take on a declared device:

- every matrix product, batched product, convolution and fused attention, forward and backward
  (the ops torch's own FLOP counter, ``torch.utils.flop_counter``, counts, with their FLOPs as it
  counts them) is **not computed**: its output is zeros of the right shape, and the rank owes
  ``FLOPs / speed`` seconds, which it spends **sleeping**;
- everything else is real: the processes, the schedule's order, every collective and
  point-to-point message with its real size over gloo, the waits, the hooks, the profiler trace,
  and the cheap element-wise work (activations, norms, softmax, the optimizer).

Each product sleeps its own time (what is still owed is also paid before any collective or
message, and when the block ends); the oversleep of one sleep is credited to the next, so the
total stays exact and a profiler trace shows each product as long as its FLOPs take. A sleeping
rank leaves the cores to the others' communication: two stages "compute" at once, a bucket's
all-reduce runs while backward goes on, a slow rank makes the others wait.

**Numerics are not real here** (the products are zeros): a cell that checks parity with one process
runs without this mode, at the same or a smaller size; a timing run under it checks only times.
Each output made this way says so in its first line (:func:`describe`). On GPUs the mode is off by
default (:func:`for_device`): real kernels are timed there.

**The default speed, 2 TFLOP/s per rank,** gives the ratio of compute to communication of a GPU
node: an H100 sustains a few hundred TFLOP/s on large bf16 products and its NVLink all-reduce about
400 GB/s of bus bandwidth, roughly 1,000 FLOPs per byte sent; gloo over loopback moves 1-2 GB/s
(``benchmarks/RESULTS.md``), and 1,000 FLOPs per byte of that is 1-2 TFLOP/s.

    from course_utils.modelled import ModelledCompute

    def worker(ctx):
        ...
        with ModelledCompute(tflops=2.0):   # products take FLOPs / 2e12 s, asleep
            loss = model(x).sum(); loss.backward()

Taught in notebook 04 first; notebooks 03b, 05, 06, 07, 09 and 10 time their schedules with it.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

DEFAULT_TFLOPS = 2.0
"""The declared speed per rank (see the module's docstring for why)."""

aten = torch.ops.aten


def _cpu_flash_attention(q, k, *args, out_val=None, **kwargs) -> float:
    """FLOPs of CPU's fused attention, which torch's counter does not list: the scores (2·Sq·Sk·D
    per batch and head) and their product with V (as many again)."""
    return 4.0 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * q.shape[-1]


def _flops(func, args, kwargs, out) -> float | None:
    """FLOPs of one op as torch's own counter (``torch.utils.flop_counter``) counts them, or None
    for an op it does not count (element-wise work, run for real)."""
    packet = func._overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet in _EXTRA:
        return _EXTRA[packet](*args, **kwargs, out_val=out) * (
            2 if "backward" in str(packet) else 1
        )
    return None


_EXTRA = {
    getattr(aten, name): _cpu_flash_attention
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    )  # fmt: skip
    if hasattr(aten, name)
}


def _signature(tree) -> tuple:
    """What decides an op's output shape and FLOPs: its arguments, tensors by shape and dtype."""
    leaves, spec = tree_flatten(tree)
    return (str(spec), *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                         for x in leaves))  # fmt: skip


def _define_compute_op():
    """``torch.ops.course.modelled_compute(seconds)``: the sleep, as an op of its own, so that a
    profiler trace records it as an operator (``course::modelled_compute``, which the course's
    analysis counts as compute, as it would the product it stands for)."""
    if hasattr(torch.ops.course, "modelled_compute"):  # already defined in this process
        return torch.ops.course.modelled_compute

    @torch.library.custom_op("course::modelled_compute", mutates_args=())
    def modelled_compute(seconds: float) -> None:
        time.sleep(seconds)

    return torch.ops.course.modelled_compute


_sleep = _define_compute_op()


def _meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _zeros_like_meta(m, device):
    if isinstance(m, torch.Tensor):
        return torch.zeros(m.shape, dtype=m.dtype, device=device)
    return m


@dataclass
class ModelledCompute(TorchDispatchMode):
    """``with ModelledCompute(tflops=2.0):``: matrix products, convolutions and fused attention
    take ``FLOPs / (tflops · 1e12)`` seconds, asleep, and return zeros (see the module).

    ``slowdown`` multiplies this rank's compute time (a straggler: ``slowdown=1.5`` on one rank).
    After the block, :attr:`flops` and :attr:`seconds` say what was modelled."""

    tflops: float = DEFAULT_TFLOPS
    slowdown: float = 1.0
    quantum: float = 0.0
    """Owed time is paid once it exceeds this many seconds (and before any communication). At 0,
    each product sleeps its own time, so a profiler trace shows it as that op's duration (what
    is not paid yet would land in the next op's, a collective's perhaps)."""
    flops: float = 0.0
    seconds: float = 0.0
    owed: float = field(default=0.0, repr=False)
    _known: dict = field(default_factory=dict, repr=False)
    _computed: int = field(default=0, repr=False)

    def __post_init__(self):
        super().__init__()
        if not self.tflops > 0 or not self.slowdown > 0:
            raise ValueError(
                f"ModelledCompute needs tflops > 0 and slowdown > 0, got tflops={self.tflops}, "
                f"slowdown={self.slowdown}"
            )

    @property
    def speed(self) -> float:
        """FLOPs per second this rank computes at."""
        return self.tflops * 1e12 / self.slowdown

    def pay(self) -> None:
        """Sleep what is owed (as the op ``course::modelled_compute``); an oversleep is credited to
        the next payment."""
        if self.owed > 0:
            t0 = time.perf_counter()
            _sleep(self.owed)
            self.owed -= time.perf_counter() - t0

    @contextlib.contextmanager
    def computed(self):
        """Inside this block products are computed for real and cost no modelled time: for small
        work whose values decide the schedule (a router choosing each token's experts)."""
        self._computed += 1
        try:
            yield self
        finally:
            self._computed -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if self._computed or (packet not in flop_registry and packet not in _EXTRA):
            if func.namespace in ("c10d", "_c10d_functional"):
                self.pay()  # the compute before a message is done before it leaves
            return func(*args, **kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        key = (func, _signature(args), _signature(kwargs))
        if key not in self._known:  # the output's shape (on the meta device) and the FLOPs, once
            out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
            self._known[key] = (out, _flops(func, args, kwargs, out))
        out, flops = self._known[key]
        self.flops += flops
        self.seconds += flops / self.speed
        self.owed += flops / self.speed
        if self.owed > self.quantum:  # inside this op: the trace shows it as its duration
            self.pay()
        return tree_map(lambda m: _zeros_like_meta(m, device), out)

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.pay()  # outside the mode: the sleep is not dispatched through it
        return out


def describe(tflops: float = DEFAULT_TFLOPS, backend: str = "gloo") -> str:
    """The first line of every output made under modelled compute."""
    where = "gloo over loopback" if backend == "gloo" else backend
    return (
        f"compute modelled at {tflops:g} TFLOP/s per rank (products asleep, not computed); "
        f"communication real, {where}"
    )


def for_device(device, tflops: float = DEFAULT_TFLOPS, **kwargs):
    """:class:`ModelledCompute` on a CPU device, a context that changes nothing on a GPU (real
    kernels are timed there)."""
    if torch.device(device).type == "cpu":
        return ModelledCompute(tflops=tflops, **kwargs)
    return contextlib.nullcontext()


__all__ = ["DEFAULT_TFLOPS", "ModelledCompute", "describe", "for_device"]
