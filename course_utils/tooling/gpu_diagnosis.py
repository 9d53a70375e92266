"""Why a node's GPUs are unusable from torch, and the one command that fixes it.

:func:`gather` reads what the node shows (``nvidia-smi``, ``rocm-smi``, ``/opt/rocm``, the device
files, torch's build and its CUDA initialisation warning) into a :class:`Probe`;
:func:`diagnose` is a pure function of that probe, so it is tested on recorded outputs of
real machines (``tests/fixtures/gpu/``). ``python -m course_utils doctor`` prints the result.

The rules, in order:

* no GPU on the node: nothing to fix, the course runs on CPU processes;
* ``CUDA_VISIBLE_DEVICES`` (or ``HIP_``/``ROCR_VISIBLE_DEVICES``) hides every GPU;
* torch sees the GPUs, but has no kernels for one of them (``torch.cuda.get_arch_list()`` against
  the device's compute capability: a V100, sm_70, under the default cu130 build): not usable, and
  the build that has them;
* torch sees the GPUs: usable, with what this torch's NCCL (or ROCm's RCCL) means for ranks that
  share a GPU;
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

from ..launcher.gpus import (
    OLD_GPU_INDEX,
    OLD_NCCL_NOTE,
    has_kernels,
    parse_arch,
)
from ..launcher.gpus import kernel_range as _archs
from ..launcher.gpus import setup_command as _setup
from ..launcher.placement import nccl_version

# The oldest driver each CUDA major release runs on (NVIDIA's CUDA toolkit release notes; a build
# for CUDA M.x runs on any driver for M.0 or newer, by CUDA's minor-version compatibility).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# The PyTorch index to use for a driver whose CUDA major release is the key.
CUDA_INDEX = {11: "cu118", 12: "cu126", 13: "cu130"}
# The first NCCL that runs several ranks of one communicator on one GPU (launcher/placement.py).
SHARING_NCCL = (2, 30)


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
    capabilities: list[tuple[int, int]] = field(default_factory=list)  # per visible device
    gpu_names: list[str] = field(default_factory=list)  # torch.cuda.get_device_name(i)
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list()
    nccl: tuple[int, ...] | None = None  # the NCCL (RCCL) bundled with torch


@dataclass
class Diagnosis:
    vendor: str | None  # "nvidia", "amd" or None (no GPU on the node)
    gpus: int  # GPUs the node has, whether or not torch can use them
    usable: bool
    problem: str | None = None
    fix: str | None = None
    notes: list[str] = field(default_factory=list)
    """What the build means for the course's placement (ranks sharing a GPU), usable or not."""

    def render(self) -> list[str]:
        if self.vendor is None:
            return ["GPU check: no GPU on this node; the course runs on CPU processes (gloo)."]
        name = "NVIDIA" if self.vendor == "nvidia" else "AMD"
        if self.usable:
            out = [f"GPU check: {self.gpus} {name} GPU(s), usable from torch."]
        else:
            out = [f"GPU check: {self.gpus} {name} GPU(s) on this node, but torch cannot use them."]
            out.append(f"  why: {self.problem}")
            if self.fix:
                out.append(f"  fix: {self.fix}")
        return out + [f"  note: {n}" for n in self.notes]


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


def _nccl(v: tuple[int, ...] | None) -> str:
    return ".".join(map(str, v)) if v else "-"


def sharing_note(p: Probe, vendor: str) -> str | None:
    """What this torch's collective library means for several ranks on one GPU."""
    if vendor == "amd" or p.torch_hip:
        return (
            "ROCm's RCCL runs one rank per GPU (on an MI250X, per GCD): the course does not share "
            "a GPU between ranks there, so with fewer GPUs than ranks a multi-rank cell runs as "
            "CPU ranks (gloo)"
        )
    if p.nccl is None:
        return None
    if tuple(p.nccl[:2]) >= SHARING_NCCL:
        return (
            f"NCCL {_nccl(p.nccl)} runs several ranks on one GPU: with fewer GPUs than ranks, "
            "multi-rank cells share the GPUs"
        )
    return (
        f"this torch's NCCL {_nccl(p.nccl)} cannot run several ranks on one GPU (that needs NCCL "
        ">= 2.30, as in the default build, torch 2.14.1+cu130 with a driver >= 580): with fewer "
        "GPUs than ranks, multi-rank cells run as CPU ranks (gloo)"
    )


def _node_gpus(p: Probe, nv: dict | None) -> tuple[str | None, int]:
    """``(vendor, count)`` of the GPUs the tools and device files show; ``(None, 0)`` for none."""
    nv_nodes = [d for d in p.dev_nodes if re.fullmatch(r"/dev/nvidia\d+", d)]
    amd_gpus = parse_rocm_smi(p.rocm_smi) if p.rocm_smi else []
    amd = bool(amd_gpus) or "/dev/kfd" in p.dev_nodes
    # a failing nvidia-smi alone is no GPU: login nodes and CPU images often have the tool only
    nvidia = bool(nv and nv["gpus"]) or bool(nv_nodes)
    if not nvidia and not amd:
        return None, 0
    vendor = "nvidia" if nvidia else "amd"
    count = (len(nv["gpus"]) if nv and nv["gpus"] else len(nv_nodes)) if nvidia else len(amd_gpus)
    return vendor, max(count, p.device_count, 1)


def _seen_by_torch(p: Probe, d: Diagnosis, vendor: str) -> Diagnosis:
    """torch sees the GPUs: usable, unless this build has no kernels for one of them."""
    missing = [i for i, cap in enumerate(p.capabilities) if not has_kernels(cap, p.arch_list)]
    if missing:
        i = missing[0]
        cap = p.capabilities[i]
        name = p.gpu_names[i] if i < len(p.gpu_names) else f"GPU {i}"
        d.problem = (
            f"{name} (compute capability {cap[0]}.{cap[1]}, sm_{cap[0]}{cap[1]}): this torch "
            f"{p.torch_version} has kernels for {_archs(p.arch_list)} only "
            "(torch.cuda.get_arch_list()), so its first kernel would fail with 'no kernel "
            "image is available for execution on the device'."
        )
        d.fix = (
            _setup(OLD_GPU_INDEX)
            + "   (torch's CUDA 12.6 builds still carry kernels for GPUs older than sm_75; "
            + OLD_NCCL_NOTE
            + ")"
        )
        return d
    d.usable = True
    note = sharing_note(p, vendor)
    d.notes = [note] if note else []
    return d


def _nvidia_unusable(p: Probe, d: Diagnosis, nv: dict | None, torch_build: str) -> Diagnosis:
    """NVIDIA GPUs torch does not see: no driver answering, a non-CUDA torch, a driver too old."""
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
        d.fix = _setup(index) + "   (a torch built for the driver's CUDA; " + OLD_NCCL_NOTE + ")"
        return d
    d.problem = f"torch ({torch_build}) found no usable GPU" + (
        f": {p.cuda_warning}" if p.cuda_warning else "."
    )
    return d


def _amd_unusable(p: Probe, d: Diagnosis, torch_build: str) -> Diagnosis:
    """AMD GPUs torch does not see: a non-ROCm torch, no access to /dev/kfd, a ROCm mismatch."""
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


def diagnose(p: Probe) -> Diagnosis:
    """The verdict on a node's GPUs, by the rules of this module's docstring, in their order."""
    nv = parse_nvidia_smi(p.nvidia_smi) if p.nvidia_smi and not p.nvidia_smi_failed else None
    vendor, count = _node_gpus(p, nv)
    if vendor is None:
        if p.cuda_available and p.device_count:  # a GPU no tool here can see: trust torch
            return Diagnosis("amd" if p.torch_hip else "nvidia", p.device_count, True)
        return Diagnosis(None, 0, False)
    d = Diagnosis(vendor, count, False)

    hidden = _hidden(p.visible)
    if hidden and not (p.cuda_available and p.device_count):
        d.problem = f"{hidden}={p.visible[hidden]!r} hides every GPU from this process."
        d.fix = f"unset {hidden}   (or set it to the GPUs this job was given, e.g. 0,1)"
        return d
    if p.cuda_available and p.device_count:
        return _seen_by_torch(p, d, vendor)
    torch_build = (
        f"CUDA {p.torch_cuda}" if p.torch_cuda else f"ROCm {p.torch_hip}" if p.torch_hip else "CPU"
    )
    if vendor == "nvidia":
        return _nvidia_unusable(p, d, nv, torch_build)
    return _amd_unusable(p, d, torch_build)


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
    caps, names, arch_list, nccl = [], [], [], None
    if available:
        try:
            caps = [tuple(torch.cuda.get_device_capability(i)) for i in range(count)]
            names = [torch.cuda.get_device_name(i) for i in range(count)]
            arch_list = list(torch.cuda.get_arch_list())
        except Exception:  # a device torch cannot query: the rules below say why
            pass
        nccl = nccl_version()
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
        capabilities=caps,
        gpu_names=names,
        arch_list=arch_list,
        nccl=nccl,
    )


__all__ = ["Probe", "Diagnosis", "diagnose", "gather", "has_kernels", "parse_arch",
           "parse_nvidia_smi", "parse_rocm_smi", "sharing_note"]  # fmt: skip
