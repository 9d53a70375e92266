"""Where ``launch`` puts its ranks: one GPU each, several ranks sharing a GPU, or CPU processes.

The rule, for ``world_size`` ranks and ``n`` visible GPUs (``device="auto"``, ``backend="auto"``):

- ``n >= world_size``: one GPU per rank, NCCL. Rank ``r`` uses ``cuda:r``.
- ``0 < n < world_size`` and NCCL >= 2.30: the ranks **share** the GPUs, round-robin (rank ``r``
  on ``cuda:r % n``), NCCL. NCCL 2.30 added running several ranks of one communicator on the same
  GPU (experimental, enabled by ``NCCL_MULTI_RANK_GPU_ENABLE=1``, which launch sets in the ranks'
  environment only); older NCCL refuses with "Duplicate GPU detected".
- otherwise: CPU processes with gloo. (A torch built without NCCL keeps the ranks on the GPUs,
  one each or shared, with gloo, which moves CUDA tensors through host memory.)

Sharing is the default on purpose. A student with one GPU (a JupyterHub slot, Colab, a MIG
slice) would otherwise run every multi-rank notebook on the CPU and never see an NCCL kernel, a
CUDA stream or a tensor left on the wrong device: shared ranks show all of those (on one GPU every
rank is ``cuda:0``, so a hard-coded ``"cuda:0"`` goes unnoticed there). What they cannot show is a
speed-up: the ranks' processes take turns on the GPU (without MPS the GPU switches between their
contexts), so timings teach the mechanics, never the scaling; the notebooks say so where they
time. Each rank has its own CUDA context (a few hundred MB) and NCCL buffers: 8 ranks on a small
MIG slice may not fit, and ``device="cpu"`` is then the way. Round-robin puts neighbouring ranks on
different GPUs (on 2 GPUs, ranks 0 and 1 do not share), which is not how a real node places a
tensor-parallel group; with one GPU it makes no difference. ``device="cpu"`` opts out;
``NCCL_MULTI_RANK_GPU_ENABLE=0`` in the environment turns sharing off. Every automatic decision
prints one line saying where the ranks run.

``device="cuda"`` (or ``backend="nccl"``) with more ranks than GPUs asks for sharing explicitly:
with an older NCCL it fails before any process starts and says what to do.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .context import cpu_threads_per_rank
from .gpus import refuse_without_kernels

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
SHARE_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
SHARING_NCCL = (2, 30, 0)
"""The first NCCL that runs several ranks of one communicator on one GPU."""


def _fmt(version: tuple[int, ...] | None) -> str:
    return "?" if version is None else ".".join(map(str, version))


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL bundled with this torch, ``(2, 30, 7)``; ``None`` without NCCL or a GPU.

    ``torch.cuda.nccl.version()`` returns a tuple in current torch and one integer in old ones
    (``2708`` for 2.7.8; ``22703`` for 2.27.3 since NCCL 2.9). It does not start CUDA.
    """
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return None
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a broken NCCL install: as good as none for launch
        return None
    if isinstance(v, int):
        return (
            (v // 10000, v // 100 % 100, v % 100)
            if v >= 10000
            else (v // 1000, v // 100 % 10, v % 100)
        )
    return tuple(int(x) for x in v[:3]) + (0,) * (3 - len(v[:3]))


@dataclass(frozen=True)
class Placement:
    """Where each of ``world_size`` ranks runs, and why."""

    world_size: int
    backend: str
    """``"nccl"`` or ``"gloo"``."""
    device_type: str
    """``"cuda"`` or ``"cpu"``."""
    gpus: tuple[int, ...]
    """``gpus[rank]``: the GPU index of each rank (empty on CPU)."""
    reason: str
    """Why the ranks run there, in a few words."""
    nccl: tuple[int, int, int] | None = None
    """The NCCL version, when GPUs are visible."""

    @property
    def shared(self) -> bool:
        """True when some GPU holds more than one rank."""
        return len(set(self.gpus)) < len(self.gpus)

    @property
    def gpu_count(self) -> int:
        """How many distinct GPUs the ranks use."""
        return len(set(self.gpus))

    def device(self, rank: int) -> torch.device:
        """``ctx.device`` of ``rank``."""
        return (
            torch.device("cuda", self.gpus[rank])
            if self.device_type == "cuda"
            else torch.device("cpu")
        )

    def rank_env(self) -> dict[str, str]:
        """Environment variables the ranks need (sharing: ``NCCL_MULTI_RANK_GPU_ENABLE=1``)."""
        return {SHARE_ENV: "1"} if self.shared and self.backend == "nccl" else {}

    def describe(self) -> str:
        """One line: where the ranks run and why (the notebooks' hardware cells print it)."""

        n, r = self.world_size, "rank" if self.world_size == 1 else "ranks"
        if self.device_type == "cpu":
            t = cpu_threads_per_rank(n)
            each = " each" if n > 1 else ""
            return f"{n} {r} on the CPU with gloo, {t} thread{'s' if t > 1 else ''}{each}: {self.reason}"
        if not self.shared:
            return f"{n} {r} on {n} GPU{'s' if n > 1 else ''}, one each, with {self.backend}"
        per = Counter(self.gpus)
        spread = ", ".join(f"cuda:{g} x{c}" for g, c in sorted(per.items()))
        if self.backend != "nccl":
            return (
                f"{n} ranks share {self.gpu_count} GPU{'s' if self.gpu_count > 1 else ''} "
                f"({spread}) with {self.backend}, which moves CUDA tensors through host memory: "
                "right for device placement, not for speed"
            )
        return (
            f"{n} ranks share {self.gpu_count} GPU{'s' if self.gpu_count > 1 else ''} ({spread}) "
            f"through NCCL {_fmt(self.nccl)}'s experimental multi-rank mode: real NCCL kernels, "
            "streams and placement, but not the speed-up of a GPU per rank"
        )


def place_ranks(
    world_size: int,
    backend: str = "auto",
    device: str = "auto",
    *,
    gpus: int | None = None,
    nccl: tuple[int, int, int] | None | str = "probe",
    env: Mapping[str, str] | None = None,
    rocm: bool | None = None,
    capabilities: list[tuple[int, int]] | None = None,
    arch_list: list[str] | None = None,
) -> Placement:
    """Where ``world_size`` ranks run on this node, or a ``ValueError`` that says what to change.

    ``gpus`` (visible GPU count), ``nccl`` (version tuple), ``env``, ``rocm`` (a ROCm build,
    whose RCCL the course does not share GPUs with), ``capabilities`` (each GPU's compute
    capability) and ``arch_list`` (``torch.cuda.get_arch_list()``) default to this machine's; tests
    pass them to play a node with 1, 2, 3 or 4 GPUs, any NCCL and any GPU generation. Ranks are
    never placed on a GPU this torch has no kernels for (a V100 under the cu130 build): the error
    names the build that has them, before any process starts.
    """
    _check_request(world_size, backend, device)
    env = os.environ if env is None else env
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nccl == "probe":
        nccl = nccl_version() if gpus else None
    if rocm is None:
        rocm = bool(getattr(torch.version, "hip", None))
    n = world_size
    cpu = Placement(n, "gloo", "cpu", (), "", nccl)

    if device == "cpu" or (backend == "gloo" and device == "auto"):
        return _with(cpu, "asked for")
    wants_gpu = device == "cuda" or backend == "nccl"
    if gpus == 0:
        if wants_gpu:
            raise ValueError(
                f"world_size={n} on the GPU, but no CUDA GPU is visible: pass device='cpu' to "
                f"simulate {n} ranks with gloo (`make doctor` says why no GPU is usable)."
            )
        return _with(cpu, "no CUDA GPU is visible")
    use = (
        "gloo"
        if backend == "gloo"
        else "nccl"
        if (backend == "nccl" or nccl is not None)
        else "gloo"
    )
    refuse_without_kernels(gpus, capabilities, arch_list)
    if gpus >= n:
        return Placement(
            n, use, "cuda", tuple(range(n)), f"{gpus} GPU{'s' if gpus > 1 else ''} visible", nccl
        )
    return _share(n, use, gpus, nccl, env, rocm, wants_gpu)


def _check_request(world_size: int, backend: str, device: str) -> None:
    """A ``ValueError`` for arguments no node could satisfy."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS}, got {backend!r} (mpi is not supported)"
        )
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if backend == "nccl" and device == "cpu":
        raise ValueError(
            "nccl only moves GPU tensors: use backend='gloo' (or 'auto') with device='cpu'"
        )


def _share(
    n: int,
    use: str,
    gpus: int,
    nccl: tuple[int, int, int] | None,
    env: Mapping[str, str],
    rocm: bool,
    wants_gpu: bool,
) -> Placement:
    """Fewer GPUs than ranks: share them round-robin where the backend can; else CPU ranks, or,
    when the GPUs were asked for (``wants_gpu``), a ``ValueError`` that says what to change."""
    off = str(env.get(SHARE_ENV, "")).strip() == "0"
    too_old = use == "nccl" and (rocm or nccl is None or nccl < SHARING_NCCL)
    shared = Placement(
        n,
        use,
        "cuda",
        tuple(r % gpus for r in range(n)),
        f"{gpus} GPU{'s' if gpus > 1 else ''} for {n} ranks",
        nccl,
    )
    if use == "gloo":  # gloo moves CUDA tensors through host memory: sharing needs nothing
        return shared
    if not off and not too_old:
        return shared
    why = (
        f"{SHARE_ENV}=0 is set"
        if off
        else "the course shares a GPU between ranks only with NVIDIA's NCCL >= 2.30, not ROCm's RCCL"
        if rocm
        else f"NCCL {_fmt(nccl)} cannot share a GPU between ranks (that needs NCCL >= "
        f"{_fmt(SHARING_NCCL[:2])}, as in torch 2.14.1: make setup)"
    )
    if wants_gpu:
        fix = (
            f"unset {SHARE_ENV}"
            if off
            else "run one rank per GPU"
            if rocm
            else "install a torch whose NCCL is >= 2.30 (`make setup`; `make doctor` shows the version)"
        )
        raise ValueError(
            f"world_size={n} but only {gpus} GPU(s) are visible, and {why}: pass device='cpu' to "
            f"simulate {n} ranks with gloo, lower world_size to {gpus}, or {fix}."
        )
    cpu = Placement(n, "gloo", "cpu", (), "", nccl)
    return _with(cpu, f"{gpus} GPU{'s' if gpus > 1 else ''} for {n} ranks, and {why}")


def _with(p: Placement, reason: str) -> Placement:
    return Placement(p.world_size, p.backend, p.device_type, p.gpus, reason, p.nccl)


def describe_placement(world_size: int) -> str:
    """Where ``world_size`` ranks of a plain ``launch`` would run on this node, in one line (or
    why ``launch`` would refuse)."""
    try:
        return place_ranks(world_size).describe()
    except ValueError as e:
        return f"{world_size} ranks: launch refuses: {e}"


__all__ = [
    "Placement",
    "place_ranks",
    "describe_placement",
    "nccl_version",
    "SHARE_ENV",
    "SHARING_NCCL",
]
