"""GPU paths: NCCL ranks, CUDA after the parent touched CUDA, AMP memory. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.measure import saved_activations
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


@pytest.mark.multiprocess
def test_more_ranks_than_gpus_falls_back_to_gloo_on_cpu(runs_root):
    res = launch("course_utils.launcher.demo:hello", torch.cuda.device_count() + 1, echo=False)
    assert res.backend == "gloo" and res.device == "cpu"


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
        assert abs(b.compute + b.communication + b.data + b.optimizer + b.idle - b.step_ms) < 1e-3


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
