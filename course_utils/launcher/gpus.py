"""Whether this torch has kernels for a GPU, and the build that has them.

``launch`` refuses, before any process starts, to place ranks on a GPU this torch has no kernels
for (a V100 under the cu130 build); ``python -m course_utils doctor``
(:mod:`course_utils.tooling.gpu_diagnosis`) gives the same verdict from the same functions.
"""

from __future__ import annotations

import re

import torch

INDEX = "https://download.pytorch.org/whl"
# Since torch 2.11 only the CUDA 12.6 builds keep kernels for GPUs older than Turing (sm_75):
# Volta's V100 (sm_70) and Pascal; the CUDA 12.8+ and 13.0 builds start at sm_75
# (``torch.cuda.get_arch_list()`` of each build).
OLD_GPU_INDEX = "cu126"
# PyTorch's CUDA 11.8 builds stop before the pinned 2.14.1: name the last release that has them.
INDEX_PINS = {"cu118": "torch==2.7.1 torchvision==0.22.1"}
OLD_NCCL_NOTE = (
    "its bundled NCCL is older than 2.30, so ranks cannot share a GPU: with fewer GPUs than ranks, "
    "multi-rank cells run as CPU ranks (gloo)"
)


def parse_arch(arch: str) -> tuple[str, tuple[int, int]] | None:
    """``"sm_75"`` → ``("sm", (7, 5))``, ``"compute_120"`` → ``("compute", (12, 0))``,
    ``"sm_90a"`` → ``("sm", (9, 0))``; ``None`` for anything else (``gfx90a`` on ROCm)."""
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", arch)
    return (m.group(1), (int(m.group(2)), int(m.group(3)))) if m else None


def has_kernels(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a build with ``arch_list`` runs on a device of ``capability``: a cubin for
    ``sm_XY`` runs on devices of the same major ``X`` and minor ``>= Y``; PTX for ``compute_XY``
    is compiled at load for any device ``>= (X, Y)`` (CUDA's compatibility rules). An empty or
    non-CUDA list (ROCm) is taken as yes: nothing to compare."""
    parsed = [a for a in map(parse_arch, arch_list) if a]
    if not parsed:
        return True
    for kind, (major, minor) in parsed:
        if kind == "sm" and capability[0] == major and capability[1] >= minor:
            return True
        if kind == "compute" and tuple(capability) >= (major, minor):
            return True
    return False


def kernel_range(arch_list: list[str]) -> str:
    """``"sm_75 to sm_120"``: the GPU generations a build's ``arch_list`` has kernels for."""
    sms = sorted({v for k, v in filter(None, map(parse_arch, arch_list)) if k == "sm"})
    return f"sm_{sms[0][0]}{sms[0][1]} to sm_{sms[-1][0]}{sms[-1][1]}" if sms else "none"


def setup_command(index: str) -> str:
    """The ``make setup`` line that installs torch from the PyTorch index ``index`` (``cu126``)."""
    pins = f' TORCH_PINS="{INDEX_PINS[index]}"' if index in INDEX_PINS else ""
    return f"make setup TORCH_INDEX={INDEX}/{index}{pins}"


def refuse_without_kernels(gpus: int, capabilities, arch_list) -> None:
    """A ``ValueError`` naming the build to install when one of the first ``gpus`` GPUs has no
    kernels in this torch; ``capabilities`` and ``arch_list`` default to this machine's."""
    try:
        if capabilities is None:
            capabilities = [tuple(torch.cuda.get_device_capability(i)) for i in range(gpus)]
        if arch_list is None:
            arch_list = list(torch.cuda.get_arch_list())
    except Exception:  # a device torch cannot query (or a node played by a test): launch says
        return  # what the device says when a rank starts; `make doctor` explains
    for i, cap in enumerate(capabilities[:gpus]):
        if not has_kernels(tuple(cap), arch_list):
            raise ValueError(
                f"cuda:{i} has compute capability {cap[0]}.{cap[1]} (sm_{cap[0]}{cap[1]}), but "
                f"this torch {torch.__version__} has kernels for {kernel_range(arch_list)} only: its "
                "first kernel would fail with 'no kernel image is available'. Install the build "
                f"that has them, `{setup_command(OLD_GPU_INDEX)}` ({OLD_NCCL_NOTE}), or pass "
                "device='cpu' to run the ranks as CPU processes now."
            )


__all__ = ["has_kernels", "kernel_range", "parse_arch", "refuse_without_kernels", "setup_command"]
