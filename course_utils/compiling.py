"""``torch.compile`` where it can work, eager mode with a one-line reason where it cannot.

Compiling needs more than torch: Inductor writes C++ for the CPU (a C++ compiler, ``g++`` or
``clang++``) and Triton kernels for NVIDIA and AMD GPUs (the ``triton`` package, and a C compiler
to build its launcher). Minimal hub images often lack one of them, and the failure comes at the
first *call* of the compiled model, as a long ``BackendCompilerFailed`` traceback. Notebook 01
compiles through :func:`compile_or_eager`, which runs that first call and, if it fails, says why
in one line and carries on with the eager model; ``doctor`` reports :func:`compile_check`.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


def reason(e: BaseException) -> str:
    """The useful line of a compile failure: ``InvalidCxxCompiler: No working C++ compiler ...``."""
    inner = getattr(e, "inner_exception", None)  # BackendCompilerFailed keeps the cause
    if isinstance(inner, BaseException) and inner is not e:
        return reason(inner)
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:  # the underlying error first, then a header and advice about verbosity
        if ln.endswith("raised:") or ln.startswith(
            ("Set TORCH", "You can suppress", "For even more")
        ):
            continue
        return f"{type(e).__name__}: {ln}"[:300]
    return type(e).__name__


@dataclass
class Compiled:
    """What :func:`compile_or_eager` hands back."""

    model: object
    """The compiled model, or the eager one when compiling failed."""
    compiled: bool
    first_call: object
    """What ``first_call(model)`` returned (run compiled, or eager after a failure)."""
    why_not: str | None = None
    """The one-line reason compiling failed (``None`` when it worked)."""


def compile_or_eager(
    model, first_call: Callable[[object], object], verbose: bool = True, **compile_kwargs
) -> Compiled:
    """``torch.compile(model)`` and run ``first_call`` on it (the call that compiles). If compiling
    fails, print one line saying why and run ``first_call`` on the eager ``model`` instead.

    Only compile failures (Dynamo's and Inductor's exceptions) are caught; an error of the model's
    own code propagates. A failure while compiling the forward comes before any of it ran; one in
    the backward (compiled at the first ``backward()``) comes after the compiled forward ran, so a
    module with running statistics (BatchNorm) then sees that first batch twice.
    """
    from torch._dynamo.exc import TorchDynamoException

    try:
        compiled = torch.compile(model, **compile_kwargs)
        out = first_call(compiled)
        return Compiled(compiled, True, out)
    except TorchDynamoException as e:  # BackendCompilerFailed, InductorError, ...: "not here"
        why = reason(e)
        if verbose:
            print(f"torch.compile does not work here ({why}); continuing in eager mode.")
        return Compiled(model, False, first_call(model), why)


_PROBE = """
import torch
def f(x):
    return torch.relu(x) * 2 + 1
x = torch.randn(64, device={device!r})
assert torch.allclose(torch.compile(f)(x), f(x))
"""


def compile_check(device_type: str = "cpu", timeout: float = 300.0) -> str:
    """``"ok"``, or why ``torch.compile`` fails on ``device_type``: compiles a small function in a
    fresh interpreter (this one's compile caches and settings stay out of it)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE.format(device=device_type)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"no answer in {timeout:.0f} s"
    if out.returncode == 0:
        return "ok"
    tail = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    for ln in tail[::-1]:  # the exception line of the traceback, before Inductor's advice
        if ":" in ln and not ln.startswith(("Set TORCH", "For even more", "You can suppress")):
            return "failed: " + ln.strip()[:300]
    return f"failed (exit {out.returncode})"


__all__ = ["Compiled", "compile_check", "compile_or_eager", "reason"]
