"""Mixed precision the GPU really has (capability faked), and torch.compile that can fail."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from course_utils import precision
from course_utils.train.ddp import amp_setup

# make test-floor runs these on the oldest torch too: autocast and torch.compile
pytestmark = [pytest.mark.floor]


def fake_gpu(monkeypatch, capability, emulation_flag=True):
    """A GPU of ``capability``; torch's is_bf16_supported answers as torch 2.14 does: True
    with emulation (every CUDA GPU), native only from 8.0. ``emulation_flag=False`` plays a
    torch whose function has no ``including_emulation`` argument."""
    native = capability >= (8, 0)
    if emulation_flag:

        def supported(including_emulation: bool = True):
            return native or including_emulation
    else:

        def supported():
            return True  # old torch: emulated bf16 counts as supported

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize(
    "capability, dtype, scaler",
    [
        ((6, 1), torch.float16, True),  # Pascal: no tensor cores either
        ((7, 0), torch.float16, True),  # V100: bf16 only emulated
        ((7, 5), torch.float16, True),  # T4
        ((8, 0), torch.bfloat16, False),  # A100
        ((8, 6), torch.bfloat16, False),  # RTX 30xx, A40
        ((9, 0), torch.bfloat16, False),  # H100
    ],
)
def test_bf16_only_where_native(monkeypatch, flag, capability, dtype, scaler):
    fake_gpu(monkeypatch, capability, flag)
    amp = precision.choose(torch.device("cuda", 0))
    assert (amp.dtype, amp.needs_scaler) == (dtype, scaler)
    if scaler:
        assert "emulate" in amp.reason and f"{capability[0]}.{capability[1]}" in amp.reason
        assert ("no tensor cores" in amp.reason) == (capability < (7, 0))


def test_cpu_autocasts_to_bf16_without_a_scaler():
    amp = precision.choose("cpu")
    assert (amp.dtype, amp.needs_scaler, amp.name) == (torch.bfloat16, False, "bf16")
    assert amp.grad_scaler().is_enabled() is False
    with amp.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_the_training_script_takes_the_same_choice(monkeypatch):
    """train/ddp.py's --amp auto on a T4-class GPU: fp16 with a GradScaler, not emulated bf16."""
    fake_gpu(monkeypatch, (7, 5))
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: ("scaler", a, k))
    _, scaler, name = amp_setup(torch.device("cuda", 0), "auto")
    assert name == "float16" and scaler is not None
    fake_gpu(monkeypatch, (9, 0))
    _, scaler, name = amp_setup(torch.device("cuda", 0), "auto")
    assert (name, scaler) == ("bfloat16", None)


NO_COMPILER = textwrap.dedent(
    """
    import torch
    from torch import nn
    from course_utils.compiling import compile_or_eager, compile_check
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    got = compile_or_eager(model, lambda m: m(x))
    assert not got.compiled and got.model is model, got
    assert "C++ compiler" in got.why_not, got.why_not
    assert torch.equal(got.first_call, model(x))
    print("CHECK", compile_check("cpu", timeout=240))
    """
)


@pytest.mark.slow
def test_without_a_compiler_the_model_runs_eagerly_and_says_why(tmp_path):
    """A hub image without g++: Inductor cannot build its CPU kernels. One line, then eager mode."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env.update(PATH=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run(
        [sys.executable, "-c", NO_COMPILER], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    said = [ln for ln in lines if ln.startswith("torch.compile does not work here")]
    assert len(said) == 1 and said[0].endswith("continuing in eager mode."), out.stdout
    check = [ln for ln in lines if ln.startswith("CHECK ")][0]
    assert check.startswith("CHECK failed:") and "C++ compiler" in check


@pytest.mark.slow
def test_where_compile_works_the_model_is_compiled():
    from torch import nn

    from course_utils.compiling import compile_or_eager

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    got = compile_or_eager(model, lambda m: m(x), verbose=False)
    assert got.compiled and got.why_not is None and got.model is not model
    torch.testing.assert_close(got.first_call, model(x))


def test_the_reason_skips_the_header_and_follows_the_cause():
    from torch._dynamo.exc import BackendCompilerFailed

    from course_utils.compiling import reason

    class Header(Exception):
        pass

    msg = (
        "backend='inductor' raised:\nInvalidCxxCompiler: No working C++ compiler\n\nSet TORCH_LOGS"
    )
    assert reason(Header(msg)) == "Header: InvalidCxxCompiler: No working C++ compiler"
    cause = RuntimeError("Cannot find a working triton installation")
    import inspect

    extra = [None] * (len(inspect.signature(BackendCompilerFailed.__init__).parameters) - 3)
    wrapped = BackendCompilerFailed(lambda: None, cause, *extra)  # 2.14 also takes a frame
    assert reason(wrapped) == "RuntimeError: Cannot find a working triton installation"


@pytest.mark.slow
def test_an_error_of_the_model_itself_is_not_called_a_compile_failure(capsys):
    from torch import nn

    from course_utils.compiling import compile_or_eager

    class Picky(nn.Module):
        def forward(self, x):
            if x.shape[0] == 3:
                raise ValueError("bad batch")
            return x * 2

    with pytest.raises(ValueError, match="bad batch"):
        compile_or_eager(Picky(), lambda m: m(torch.ones(3, 2)))
    assert "torch.compile does not work here" not in capsys.readouterr().out
