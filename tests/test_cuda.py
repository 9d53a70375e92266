"""GPU paths: NCCL ranks, CUDA after the parent touched CUDA, AMP memory. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.measure import saved_activations, worst
from course_utils.models import SmallResNet
from tests.conftest import requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def gpu_worker(ctx):
    x = torch.randn(256, 256, device=ctx.device)
    y = (x @ x).sum()
    dist.all_reduce(y)
    return {
        "device": str(ctx.device),
        "backend": dist.get_backend(),
        "finite": bool(torch.isfinite(y)),
    }


@pytest.mark.multiprocess
def test_nccl_ranks_after_parent_initialised_cuda(runs_root):
    torch.ones(1, device="cuda")  # the parent (a notebook) already has a CUDA context
    n = torch.cuda.device_count()
    res = launch(gpu_worker, n, echo=False)
    assert res.backend == "nccl" and res.device == "cuda"
    assert [r["device"] for r in res.results] == [f"cuda:{i}" for i in range(n)]
    assert all(r["backend"] == "nccl" and r["finite"] for r in res.results)


def can_share() -> bool:
    from course_utils.launcher.placement import SHARING_NCCL, nccl_version

    v = nccl_version()
    return v is not None and v >= SHARING_NCCL and not getattr(torch.version, "hip", None)


requires_sharing = pytest.mark.skipif(
    not torch.cuda.is_available() or not can_share(),
    reason="ranks sharing a GPU need NCCL >= 2.30 (torch 2.14.1 bundles 2.30.7)",
)


@pytest.mark.multiprocess
def test_more_ranks_than_gpus_share_them_or_fall_back_to_gloo(runs_root):
    n = torch.cuda.device_count() + 1
    res = launch("course_utils.launcher.demo:hello", n, echo=False)
    assert [r["sum"] for r in res.results] == [n * (n + 1) / 2] * n
    if can_share():  # round-robin: the last rank is back on GPU 0
        assert res.backend == "nccl" and res.device == "cuda"
        assert res.results[-1]["device"] == "cuda:0"
    else:
        assert res.backend == "gloo" and res.device == "cpu"


def shared_worker(ctx):
    import os

    t = torch.full((1 << 20,), ctx.rank + 1.0, device=ctx.device)
    dist.all_reduce(t)
    return {
        "device": str(ctx.device),
        "backend": dist.get_backend(),
        "sum": t[0].item(),
        "all_equal": bool((t == t[0]).all()),
        "switch": os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE"),
    }


@pytest.mark.multiprocess
@requires_sharing
def test_four_nccl_ranks_on_one_gpu(runs_root, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    res = launch(shared_worker, 4, echo=False)
    assert res.backend == "nccl" and res.device == "cuda"
    assert [r["device"] for r in res.results] == ["cuda:0"] * 4
    assert all(r["backend"] == "nccl" and r["all_equal"] for r in res.results)
    assert [r["sum"] for r in res.results] == [10.0] * 4  # 1 + 2 + 3 + 4, on the GPU
    assert {r["switch"] for r in res.results} == {"1"}  # set for the ranks...
    assert "NCCL_MULTI_RANK_GPU_ENABLE" not in __import__("os").environ  # ...not for us
    assert "4 ranks share 1 GPU" in capsys.readouterr().out


@pytest.mark.multiprocess
@requires_sharing
def test_a_ddp_step_on_shared_gpu_ranks_equals_one_process(runs_root, monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    from course_utils.data_parallel.parity import parity_worker
    from course_utils.models import ToyMLP

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    res = launch(
        parity_worker, 4, make_model=ToyMLP, wrap=DistributedDataParallel, steps=3, echo=False
    )
    assert res.device == "cuda"
    assert worst(d for r in res.results for d in r) < 1e-12  # float64 on NCCL, against one process


@pytest.mark.notebook
@requires_sharing
@pytest.mark.parametrize("name", ["03_ddp", "04_profiling"])
def test_notebooks_03_and_04_on_ranks_sharing_one_gpu(name, tmp_path, monkeypatch):
    """Their workers (DDP from scratch and torch's, the profiled DDP run with NCCL kernels in its
    traces) on ranks that share one GPU, at the ci size."""
    from pathlib import Path

    from course_utils.tooling.course import execute

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("COURSE_SIZE", "ci")
    nb = Path(__file__).resolve().parents[1] / "notebooks" / f"{name}.ipynb"
    status, seconds, error = execute(nb, tmp_path, timeout=1200)
    assert status == "ok", error


def test_bf16_autocast_halves_activation_memory_on_gpu():
    model = SmallResNet(width=16).cuda()
    x = torch.randn(32, 3, 32, 32, device="cuda")
    with saved_activations() as fp32:
        model(x).sum()
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    with torch.autocast("cuda", dtype=dtype), saved_activations() as low:
        model(x).float().sum()
    assert low["bytes"] < 0.75 * fp32["bytes"]


def profiled_gpu_worker(ctx, steps=4):
    model = torch.nn.parallel.DistributedDataParallel(
        SmallResNet(width=16).to(ctx.device), device_ids=[ctx.local_rank]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 3, 32, 32, device=ctx.device)
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ctx.step()


@pytest.mark.multiprocess
def test_gpu_trace_has_kernels_and_analyses(runs_root):
    from course_utils.profiling import ProfileConfig
    from course_utils.profiling.analysis import analyse
    from course_utils.profiling.trace import load_traces

    n = torch.cuda.device_count()
    res = launch(
        profiled_gpu_worker, n, profile=ProfileConfig(wait=1, warmup=1, active=2), echo=False
    )
    traces = load_traces(res.traces)
    assert all(t.has_gpu for t in traces.values()), "CUDA activity missing from the trace"
    a = analyse(traces)
    for b in a.steps:
        assert b.compute > 0
        assert (
            abs(b.compute + b.memory + b.communication + b.data + b.optimizer + b.idle - b.step_ms)
            < 1e-3
        )


def test_ddp_script_under_torchrun_with_nccl_and_amp(tmp_path):
    """train/ddp.py on every GPU with NCCL and AMP (bf16 where supported, else fp16 + scaler), one
    trace per rank with CUDA kernels in it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    n = torch.cuda.device_count()
    job = tmp_path / "job"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
         str(repo / "train" / "ddp.py"), "--size", "ci", "--epochs", "2", "--job-dir", str(job)],
        check=True, timeout=600,
    )  # fmt: skip
    r = json.loads((job / "result.json").read_text())
    assert r["backend"] == "nccl" and r["world_size"] == n
    assert r["amp"] in ("bfloat16", "float16")
    assert [x["device"] for x in sorted(r["ranks"], key=lambda x: x["rank"])] == [
        f"cuda:{i}" for i in range(n)
    ]
    trace = json.loads(Path(r["traces"][0]).read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
