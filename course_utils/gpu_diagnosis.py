"""Why a node's GPUs are unusable from torch, and the one command that fixes it.

:func:`gather` reads what the node shows (``nvidia-smi``, ``rocm-smi``, ``/opt/rocm``, the device
files, torch's build and its CUDA initialisation warning) into a :class:`Probe`;
:func:`diagnose` is a pure function of that probe, so it is tested on recorded outputs of
real machines (``tests/fixtures/gpu/``). ``python -m course_utils doctor`` prints the result.

The rules, in order:

* no GPU on the node: nothing to fix, the course runs on CPU processes;
* ``CUDA_VISIBLE_DEVICES`` (or ``HIP_``/``ROCR_VISIBLE_DEVICES``) hides every GPU;
* torch sees the GPUs: usable;
* NVIDIA GPUs with a CPU-only or a ROCm torch; with a driver too old for torch's CUDA; with no
  driver loaded;
* AMD GPUs with a CPU-only or a CUDA torch; without permission on ``/dev/kfd``; with a ROCm
  release other than torch's.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass, field

INDEX = "https://download.pytorch.org/whl"
# The oldest driver each CUDA major release runs on (NVIDIA's CUDA toolkit release notes; a build
# for CUDA M.x runs on any driver for M.0 or newer, by CUDA's minor-version compatibility).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# The PyTorch index to use for a driver whose CUDA major release is the key.
CUDA_INDEX = {11: "cu118", 12: "cu126", 13: "cu130"}


@dataclass
class Probe:
    """What the node shows; every field can be recorded and replayed."""

    nvidia_smi: str | None = None  # `nvidia-smi` output (its default table), None: not installed
    nvidia_smi_failed: bool = False  # nvidia-smi exited non-zero (its message is in nvidia_smi)
    rocm_smi: str | None = None  # `rocm-smi --showproductname`, None: not installed
    rocm_version: str | None = None  # /opt/rocm/.info/version
    dev_nodes: list[str] = field(default_factory=list)  # /dev/nvidia0.., /dev/kfd
    kfd_access: bool = True  # read+write permission on /dev/kfd
    torch_version: str = ""
    torch_cuda: str | None = None  # torch.version.cuda
    torch_hip: str | None = None  # torch.version.hip
    cuda_available: bool = False
    device_count: int = 0
    cuda_warning: str | None = None  # what torch warned while looking for GPUs
    visible: dict[str, str] = field(default_factory=dict)  # *_VISIBLE_DEVICES that are set


@dataclass
class Diagnosis:
    vendor: str | None  # "nvidia", "amd" or None (no GPU on the node)
    gpus: int  # GPUs the node has, whether or not torch can use them
    usable: bool
    problem: str | None = None
    fix: str | None = None

    def render(self) -> list[str]:
        if self.vendor is None:
            return ["GPU check: no GPU on this node; the course runs on CPU processes (gloo)."]
        name = "NVIDIA" if self.vendor == "nvidia" else "AMD"
        if self.usable:
            return [f"GPU check: {self.gpus} {name} GPU(s), usable from torch."]
        out = [f"GPU check: {self.gpus} {name} GPU(s) on this node, but torch cannot use them."]
        out.append(f"  why: {self.problem}")
        if self.fix:
            out.append(f"  fix: {self.fix}")
        return out


def _major_minor(v: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_nvidia_smi(text: str) -> dict:
    """Driver version, the highest CUDA version it supports, and the GPU names of the table."""
    driver = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    # GPU rows: "|   0  NVIDIA A100-SXM4-40GB          On  | 00000000:07:00.0 Off |"
    names = re.findall(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|", text, re.M)
    return {
        "driver": driver.group(1) if driver else None,
        "cuda": cuda.group(1) if cuda else None,
        "gpus": [n.strip() for _, n in names],
    }


def parse_rocm_smi(text: str) -> list[str]:
    """The GPU indices ``rocm-smi --showproductname`` lists (``GPU[0] : Card series: ...``)."""
    return sorted(set(re.findall(r"^GPU\[(\d+)\]", text, re.M)), key=int)


def _hidden(visible: dict[str, str]) -> str | None:
    for var, value in visible.items():
        if value.strip() in ("", "-1", "none", "NoDevFiles"):
            return var
    return None


# PyTorch's CUDA 11.8 builds stop before the pinned 2.14.1: name the last release that has them.
INDEX_PINS = {"cu118": "torch==2.7.1 torchvision==0.22.1"}


def _setup(index: str) -> str:
    pins = f' TORCH_PINS="{INDEX_PINS[index]}"' if index in INDEX_PINS else ""
    return f"make setup TORCH_INDEX={INDEX}/{index}{pins}"


def diagnose(p: Probe) -> Diagnosis:
    nv = parse_nvidia_smi(p.nvidia_smi) if p.nvidia_smi and not p.nvidia_smi_failed else None
    nv_nodes = [d for d in p.dev_nodes if re.fullmatch(r"/dev/nvidia\d+", d)]
    amd_gpus = parse_rocm_smi(p.rocm_smi) if p.rocm_smi else []
    amd = bool(amd_gpus) or "/dev/kfd" in p.dev_nodes
    # a failing nvidia-smi alone is no GPU: login nodes and CPU images often have the tool only
    nvidia = bool(nv and nv["gpus"]) or bool(nv_nodes)
    if not nvidia and not amd:
        if p.cuda_available and p.device_count:  # a GPU no tool here can see: trust torch
            return Diagnosis("amd" if p.torch_hip else "nvidia", p.device_count, True)
        return Diagnosis(None, 0, False)
    vendor = "nvidia" if nvidia else "amd"
    count = (len(nv["gpus"]) if nv and nv["gpus"] else len(nv_nodes)) if nvidia else len(amd_gpus)
    count = max(count, p.device_count, 1)
    d = Diagnosis(vendor, count, False)

    hidden = _hidden(p.visible)
    if hidden and not (p.cuda_available and p.device_count):
        d.problem = f"{hidden}={p.visible[hidden]!r} hides every GPU from this process."
        d.fix = f"unset {hidden}   (or set it to the GPUs this job was given, e.g. 0,1)"
        return d
    if p.cuda_available and p.device_count:
        d.usable = True
        return d
    torch_build = (
        f"CUDA {p.torch_cuda}" if p.torch_cuda else f"ROCm {p.torch_hip}" if p.torch_hip else "CPU"
    )
    if vendor == "nvidia":
        driver_cuda = _major_minor(nv["cuda"]) if nv else None
        index = CUDA_INDEX.get(driver_cuda[0], "cu126") if driver_cuda else "cu126"
        if p.nvidia_smi_failed:  # device files, but the driver does not answer
            said = (p.nvidia_smi or "").strip().splitlines()
            d.problem = (
                "the NVIDIA driver does not answer"
                + (f" (nvidia-smi: {said[0]})" if said else "")
                + (f"; torch says: {p.cuda_warning}" if p.cuda_warning else "")
            )
            d.fix = (
                "not a course set-up problem: run on a node whose driver is loaded (on a "
                "cluster, a GPU job: srun --gpus=1 ...), or ask the administrators"
            )
            return d
        if p.torch_cuda is None:
            kind = f"a ROCm (AMD) build, ROCm {p.torch_hip}" if p.torch_hip else "a CPU-only build"
            d.problem = f"this torch {p.torch_version} is {kind}; it cannot drive NVIDIA GPUs."
            d.fix = _setup(index)
            return d
        torch_cuda = _major_minor(p.torch_cuda)
        if driver_cuda and torch_cuda and driver_cuda[0] < torch_cuda[0]:
            d.problem = (
                f"the driver {nv['driver']} supports CUDA up to {nv['cuda']}; this torch "
                f"{p.torch_version} is built for CUDA {p.torch_cuda}, which needs a driver "
                f">= {MIN_DRIVER.get(torch_cuda[0], 'newer')}."
            )
            d.fix = _setup(index) + "   (a torch built for the driver's CUDA)"
            return d
        d.problem = f"torch ({torch_build}) found no usable GPU" + (
            f": {p.cuda_warning}" if p.cuda_warning else "."
        )
        return d
    # AMD
    rocm = _major_minor(p.rocm_version)
    index = f"rocm{rocm[0]}.{rocm[1]}" if rocm else "rocmX.Y"
    fix = _setup(index) + (
        "   (or the nearest ROCm index pytorch.org lists for this torch version; its wheels carry "
        "their own ROCm libraries)"
        if rocm
        else "   (X.Y: the node's ROCm release, `cat /opt/rocm/.info/version`, or the nearest "
        "ROCm index pytorch.org lists)"
    )
    if p.torch_hip is None:
        kind = f"a CUDA (NVIDIA) build, CUDA {p.torch_cuda}" if p.torch_cuda else "a CPU-only build"
        d.problem = f"this torch {p.torch_version} is {kind}; it cannot drive AMD GPUs."
        d.fix = fix + "; or, where the site provides PyTorch: make setup USE_SYSTEM_TORCH=1"
        return d
    if "/dev/kfd" in p.dev_nodes and not p.kfd_access:
        d.problem = "this user may not open /dev/kfd (ROCm's compute device)."
        d.fix = "ask the administrators to add you to the 'render' and 'video' groups"
        return d
    hip = _major_minor(p.torch_hip)
    if rocm and hip and rocm[0] != hip[0]:
        d.problem = (
            f"this torch is built for ROCm {p.torch_hip}; the node has ROCm {p.rocm_version}, "
            "a major release apart: its kernel driver may not serve this torch's runtime."
        )
        d.fix = fix
        return d
    d.problem = f"torch ({torch_build}) found no usable GPU" + (
        f": {p.cuda_warning}" if p.cuda_warning else "."
    )
    return d


def _run(cmd: list[str]) -> tuple[str | None, bool]:
    if not shutil.which(cmd[0]):
        return None, False
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (subprocess.SubprocessError, OSError) as e:
        return str(e), True
    return (r.stdout + r.stderr), r.returncode != 0


def gather() -> Probe:
    """Read this node into a :class:`Probe` (runs nvidia-smi / rocm-smi when installed)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    said = [
        str(w.message).strip()
        for w in caught
        if "CUDA" in str(w.message) or "HIP" in str(w.message)
    ]
    nv_out, nv_failed = _run(["nvidia-smi"])
    rocm_out, _ = _run(["rocm-smi", "--showproductname"])
    try:
        with open("/opt/rocm/.info/version") as f:
            rocm_version = f.read().strip() or None
    except OSError:
        rocm_version = None
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*")) + (
        ["/dev/kfd"] if os.path.exists("/dev/kfd") else []
    )
    return Probe(
        nvidia_smi=nv_out,
        nvidia_smi_failed=nv_failed,
        rocm_smi=rocm_out,
        rocm_version=rocm_version,
        dev_nodes=nodes,
        kfd_access=os.access("/dev/kfd", os.R_OK | os.W_OK) if "/dev/kfd" in nodes else True,
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        torch_hip=getattr(torch.version, "hip", None),
        cuda_available=available,
        device_count=count,
        cuda_warning=said[0].splitlines()[0] if said else None,
        visible={
            v: os.environ[v]
            for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
            if v in os.environ
        },
    )


__all__ = ["Probe", "Diagnosis", "diagnose", "gather", "parse_nvidia_smi", "parse_rocm_smi"]
