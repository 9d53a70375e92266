"""``python -m course_utils doctor``: what this node can run, checked for real.

It reports versions, GPUs and their interconnect, the CPU cores this process may
use (affinity mask and cgroup quota), where launched ranks will run, the data
found, the size the notebooks will pick, and, with its checks on, runs a real
all_reduce through :func:`course_utils.launch` on each backend (gloo: 2 CPU ranks;
nccl: 2 ranks, one GPU each, or sharing one GPU where NCCL >= 2.30 allows it) and
compiles a small function with ``torch.compile`` on each device.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..compat import FLOOR, TESTED, older_than_floor
from ..compiling import compile_check
from ..cpus import cpu_budget
from ..data import DATASETS, data_root, load_dataset
from ..launcher import describe_placement, launch, place_ranks
from ..launcher.rundir import runs_root
from ..sizes import get_size, size_choice
from .gpu_diagnosis import Diagnosis, diagnose, gather


def _gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
            }
        )
    return out


def _topology(rocm: bool) -> tuple[str, str] | None:
    """(command, output): ``nvidia-smi topo -m``, or ``rocm-smi --showtopo`` on ROCm."""
    cmd = ["rocm-smi", "--showtopo"] if rocm else ["nvidia-smi", "topo", "-m"]
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (subprocess.SubprocessError, OSError) as e:
        out = f"failed: {e}"
    return " ".join(cmd), out


def _check_backend(backend: str, world_size: int) -> dict:
    t0 = time.perf_counter()
    where = ""
    try:
        res = launch(
            "course_utils.launcher.demo:hello",
            world_size,
            backend=backend,
            device="cuda" if backend == "nccl" else "cpu",
            echo=False,
            timeout=120,
        )
        devices = [r["device"] for r in res.results]
        if backend == "nccl" and len(set(devices)) < len(devices):
            where = f" on one shared GPU ({devices[0]})"
        expected = world_size * (world_size + 1) / 2
        ok = all(r["sum"] == expected for r in res.results)
        status = "ok" if ok else f"wrong sum {[r['sum'] for r in res.results]}, expected {expected}"
    except Exception as e:
        status = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    return {
        "world_size": world_size,
        "where": where,
        "all_reduce": status,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def collect(run_checks: bool = True) -> dict:
    """Everything the doctor reports, as a dict (``--json`` prints it as is)."""
    # first, before anything touches torch.cuda: torch warns why CUDA is unusable only once
    diagnosis = diagnose(gather())
    budget = cpu_budget()
    hip = getattr(torch.version, "hip", None)
    nccl = None  # on a ROCm build, torch.cuda.nccl is RCCL
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    topo = _topology(rocm=bool(hip) or diagnosis.vendor == "amd")
    try:
        import torchvision

        tv = torchvision.__version__
    except Exception as e:  # a broken torchvision install is exactly what the doctor should say
        tv = f"import failed: {e}"
    gpus = _gpus()
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": tv,
        "torch_floor": FLOOR,
        "torch_tested": TESTED,
        "cuda_runtime": torch.version.cuda,
        "hip_runtime": hip,
        "nccl": nccl,
        "gpus": gpus,
        "gpu_check": asdict(diagnosis),
        "interconnect": topo,
        "cpu_cores": budget.usable,
        "cpu": asdict(budget) | {"usable": budget.usable, "described": budget.describe()},
        "placement": {n: describe_placement(n) for n in (2, 4, 8)},
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "size": get_size().asdict()
        | {
            "chosen_by": "COURSE_SIZE" if os.environ.get("COURSE_SIZE") else "auto",
            "why": size_choice()[1],
        },
        "data_dir": str(data_root()),
        "runs_dir": str(runs_root()),
        "data": {
            name: "absent (synthetic stand-in)"
            if load_dataset(name, limit=1, verify=False).synthetic
            else "present"
            for name in DATASETS
        },
        "checks": {},
    }
    if run_checks:
        if dist.is_gloo_available():
            info["checks"]["gloo"] = _check_backend("gloo", 2)
        if gpus and dist.is_nccl_available():
            # two ranks: on two GPUs, or sharing one where NCCL allows it (placement.place_ranks)
            shareable = place_ranks(2).device_type == "cuda"
            info["checks"]["nccl"] = _check_backend("nccl", 2 if shareable else 1)
        info["compile"] = {"cpu": compile_check("cpu")}
        if gpus:
            info["compile"]["cuda"] = compile_check("cuda")
    return info


def render(info: dict) -> str:
    """The report as a person reads it."""
    if info.get("hip_runtime"):
        runtime = f"ROCm/HIP {info['hip_runtime']}, RCCL {info['nccl'] or '-'}"
    else:
        runtime = f"CUDA runtime {info['cuda_runtime'] or '-'}, NCCL {info['nccl'] or '-'}"
    lines = [
        f"Python {info['python']} on {info['platform']}",
        f"torch {info['torch']}, torchvision {info['torchvision']}, {runtime}",
        f"  the course needs torch >= {info['torch_floor']} (tested with {info['torch_floor']} "
        f"and {info['torch_tested']})",
    ]
    if older_than_floor(info["torch"]):
        lines.append(
            f"  WARNING: torch {info['torch']} is older than the course's floor; "
            "run `make setup` for the tested version"
        )
    cpu = info.get("cpu", {}).get("described", f"{info['cpu_cores']} usable")
    lines.append(f"CPU cores: {cpu}")
    if info["gpus"]:
        lines.append(f"GPUs: {len(info['gpus'])}")
        lines += [
            f"  cuda:{g['index']}  {g['name']}  {g['memory_gib']} GiB  (sm {g['capability']})"
            for g in info["gpus"]
        ]
    else:
        lines.append("GPUs: none visible. Multi-rank notebooks run as CPU processes with gloo.")
    lines += Diagnosis(**info["gpu_check"]).render()
    if info["interconnect"]:
        cmd, out = info["interconnect"]
        lines += [f"GPU interconnect ({cmd}):", *("  " + ln for ln in out.splitlines())]
    lines.append("Backends compiled in: " + ", ".join(k for k, v in info["backends"].items() if v))
    for backend, check in info["checks"].items():
        lines.append(
            f"  {backend}: {check['world_size']}-rank all_reduce{check.get('where', '')} "
            f"{check['all_reduce']} ({check['seconds']} s)"
        )
    for dev, status in info.get("compile", {}).items():
        lines.append(f"  torch.compile on {dev}: {status}")
    if info.get("placement"):
        lines.append("Ranks from launch():")
        lines += [f"  {line}" for line in info["placement"].values()]
    s = info["size"]
    lines.append(
        f"Size: {s['name']} ({s.get('why', s['chosen_by'])}; COURSE_SIZE=ci|cpu|gpu to change): "
        f"{s['train_samples']} training images, batch {s['batch_size']}, width {s['width']}, "
        f"{s['world_size']} ranks"
    )
    lines.append(f"Data dir: {info['data_dir']}")
    lines += [f"  {name}: {state}" for name, state in info["data"].items()]
    lines.append(f"Run dirs: {info['runs_dir']}")
    return "\n".join(lines)


def main(as_json: bool = False, run_checks: bool = True) -> int:
    info = collect(run_checks)
    print(json.dumps(info, indent=2) if as_json else render(info))
    failed = [b for b, c in info["checks"].items() if c["all_reduce"] != "ok"]
    gpu = info["gpu_check"]
    return 1 if failed or (gpu["vendor"] and not gpu["usable"]) else 0


__all__ = ["collect", "render", "main"]
