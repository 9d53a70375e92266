"""Which 16-bit type to train in, on the device at hand: one choice for the whole course.

bfloat16 has float32's exponent range, so gradients underflow and overflow no more than in float32
and no loss scaling is needed; float16 has 3 more mantissa bits but a narrow range, so it needs a
``GradScaler`` (scale the loss up before backward, unscale before the step, skip steps whose
gradients overflowed). Both halve activation memory; the speed-up comes from tensor cores that do
the type natively.

``torch.cuda.is_bf16_supported()`` also answers True on GPUs that only *emulate* bfloat16 (V100,
T4: compute capability 7.x, common on hubs and Colab): there bf16 runs through float32 units, slower
than float16, and the float16 + ``GradScaler`` path a student should see never runs. So bf16 is
chosen only where it is native: ``is_bf16_supported(including_emulation=False)`` on torch builds
that have the argument, else compute capability >= 8.0 (Ampere). CPU autocast uses bfloat16, its
default low-precision type; it is fast only on CPUs with bf16 instructions (AVX512-BF16 or AMX on
recent Intel and AMD server CPUs, BF16 on recent Arm), elsewhere oneDNN converts through float32
and bf16 can be slower than float32.
Used by notebooks 01 and 03 and ``train/ddp.py``::

    from course_utils.precision import choose
    amp = choose(device)                       # Precision(dtype=torch.bfloat16, ...)
    with torch.autocast(device.type, dtype=amp.dtype): ...
    scaler = amp.grad_scaler()                 # enabled only for float16
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """A mixed-precision choice for one device."""

    device_type: str
    dtype: torch.dtype
    """``torch.bfloat16`` or ``torch.float16``: what autocast computes in."""
    needs_scaler: bool
    """True for float16: train with a ``GradScaler``."""
    reason: str
    """Why this type, in a few words."""

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self):
        """``torch.autocast`` for this device and type."""
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self, **kwargs):
        """A ``GradScaler``, enabled only when the type needs one (a no-op pass-through otherwise);
        ``kwargs`` go to it (``init_scale=...``)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.needs_scaler, **kwargs)


def bf16_is_native(device: torch.device | str | int | None = None) -> bool:
    """True when the GPU computes bfloat16 in hardware (not emulated through float32)."""
    if getattr(torch.version, "hip", None):  # ROCm: torch answers True on every ROCm build
        return bool(torch.cuda.is_bf16_supported())
    index = torch.device("cuda", device).index if isinstance(device, int) else None
    if device is not None and not isinstance(device, int):
        index = torch.device(device).index
    asks_current = index is None or index == torch.cuda.current_device()
    if (
        asks_current
        and "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters
    ):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))  # the current GPU
    major, _ = torch.cuda.get_device_capability(device)  # another GPU, or an older torch
    return major >= 8


def cpu_bf16_instructions() -> dict[str, bool] | None:
    """Whether this CPU has instructions that compute in bfloat16 (``avx512_bf16``: AVX-512
    dot products; ``amx_bf16``: AMX tiles), from Linux's ``/proc/cpuinfo``; None where it cannot
    be read. oneDNN's fast bf16 kernels need them; without them, bf16 on a CPU saves memory but
    rarely time."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return None
    return {name: name in flags for name in ("avx512_bf16", "amx_bf16")}


def choose(device: torch.device | str) -> Precision:
    """The 16-bit type to autocast to on ``device``: native bf16, else fp16 with a scaler."""
    device = torch.device(device)
    if device.type != "cuda":
        return Precision(
            device.type, torch.bfloat16, False, "CPU autocast computes in bfloat16, its default"
        )
    if bf16_is_native(device):
        return Precision("cuda", torch.bfloat16, False, "this GPU computes bfloat16 natively")
    major, minor = torch.cuda.get_device_capability(device)
    why = (
        f"this GPU (compute capability {major}.{minor}) would only emulate bfloat16: "
        "float16 with a GradScaler instead"
    )
    if major < 7:  # Pascal and older: no tensor cores
        why += "; it has no tensor cores, so 16 bits save memory here, not time"
    return Precision("cuda", torch.float16, True, why)


__all__ = ["Precision", "bf16_is_native", "choose", "cpu_bf16_instructions"]
