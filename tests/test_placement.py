"""Where ranks run on the GPUs a node really has: placement, the NCCL gate, the size that follows.

The node is played by arguments (``gpus``, ``nccl``, ``env``) or by faking what torch reports, so
these run on the CPU; ``tests/test_cuda.py`` runs shared-GPU ranks for real where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

from course_utils import dist as cdist
from course_utils import sizes
from course_utils.launcher import placement, resolve_backend
from course_utils.launcher.placement import SHARE_ENV, place_ranks

NEW, OLD = (2, 30, 7), (2, 27, 3)


def node(world_size, gpus, nccl=NEW, env=None, **kw):
    return place_ranks(world_size, gpus=gpus, nccl=nccl, env=env or {}, rocm=False, **kw)


@pytest.mark.parametrize(
    "ranks, gpus, expected",
    [
        (4, 1, (0, 0, 0, 0)),
        (4, 2, (0, 1, 0, 1)),
        (4, 3, (0, 1, 2, 0)),
        (4, 4, (0, 1, 2, 3)),
        (8, 1, (0,) * 8),
        (8, 2, (0, 1) * 4),
        (8, 3, (0, 1, 2, 0, 1, 2, 0, 1)),
        (8, 4, (0, 1, 2, 3) * 2),
    ],
)
def test_ranks_go_round_robin_over_the_gpus(ranks, gpus, expected):
    p = node(ranks, gpus)
    assert (p.backend, p.device_type, p.gpus) == ("nccl", "cuda", expected)
    assert [p.device(r) for r in range(ranks)] == [torch.device("cuda", g) for g in expected]
    assert p.shared == (gpus < ranks)
    # the multi-rank switch is set for the ranks only when a GPU holds several ranks
    assert p.rank_env() == ({SHARE_ENV: "1"} if gpus < ranks else {})


def test_enough_gpus_one_each_and_the_line_says_so():
    p = node(4, 8)
    assert p.gpus == (0, 1, 2, 3) and not p.shared
    assert p.describe() == "4 ranks on 4 GPUs, one each, with nccl"


def test_shared_line_names_the_gpus_and_the_limits_of_sharing():
    line = node(4, 3).describe()
    assert "4 ranks share 3 GPUs (cuda:0 x2, cuda:1 x1, cuda:2 x1)" in line
    assert "NCCL 2.30.7" in line and "not the speed-up" in line


@pytest.mark.parametrize("nccl", [OLD, (2, 29, 9)])
def test_old_nccl_falls_back_to_cpu_and_says_why(nccl):
    p = node(4, 1, nccl=nccl)
    assert (p.backend, p.device_type, p.gpus) == ("gloo", "cpu", ())
    assert "cannot share a GPU between ranks" in p.reason and ">= 2.30" in p.reason
    assert p.describe().startswith("4 ranks on the CPU with gloo")


@pytest.mark.parametrize("nccl", [(2, 30, 0), (2, 30, 7), (3, 0, 0)])
def test_the_gate_opens_at_nccl_2_30(nccl):
    assert node(4, 1, nccl=nccl).shared


@pytest.mark.parametrize("how", [dict(device="cuda"), dict(backend="nccl")])
def test_asking_for_gpus_with_old_nccl_is_refused_with_the_way_out(how):
    with pytest.raises(ValueError) as info:
        node(4, 2, nccl=OLD, **how)
    msg = str(info.value)
    assert "only 2 GPU(s)" in msg and "NCCL 2.27.3" in msg
    assert "pass device='cpu' to simulate 4 ranks with gloo" in msg
    assert "lower world_size to 2" in msg and "NCCL is >= 2.30" in msg


def test_explicit_cuda_with_new_nccl_shares():
    p = node(4, 1, device="cuda")
    assert p.shared and p.backend == "nccl"


def test_sharing_can_be_switched_off():
    p = node(4, 1, env={SHARE_ENV: "0"})
    assert p.device_type == "cpu" and f"{SHARE_ENV}=0" in p.reason
    with pytest.raises(ValueError, match=f"unset {SHARE_ENV}"):
        node(4, 1, env={SHARE_ENV: "0"}, device="cuda")


def test_rocm_does_not_share():
    p = place_ranks(4, gpus=1, nccl=(2, 30, 0), env={}, rocm=True)
    assert p.device_type == "cpu" and "RCCL" in p.reason


def test_cpu_when_asked_or_when_there_is_no_gpu():
    assert node(4, 2, device="cpu").device_type == "cpu"
    assert node(4, 2, backend="gloo").device_type == "cpu"
    p = node(4, 0, nccl=None)
    assert p.device_type == "cpu" and p.reason == "no CUDA GPU is visible"
    with pytest.raises(ValueError, match="no CUDA GPU is visible: pass device='cpu'"):
        node(4, 0, nccl=None, device="cuda")


def test_a_torch_without_nccl_uses_gloo_on_the_gpus():
    p = node(4, 1, nccl=None)
    assert (p.backend, p.device_type, p.gpus) == ("gloo", "cuda", (0, 0, 0, 0))


def test_gloo_on_gpus_needs_no_nccl():
    p = node(4, 1, nccl=OLD, backend="gloo", device="cuda")
    assert (p.backend, p.gpus) == ("gloo", (0, 0, 0, 0)) and p.rank_env() == {}


@pytest.mark.parametrize(
    "raw, expected", [((2, 30, 7), (2, 30, 7)), (23007, (2, 30, 7)), (2708, (2, 7, 8))]
)
def test_nccl_version_in_every_format_torch_reports(monkeypatch, raw, expected):
    fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: raw)
    assert placement.nccl_version() == expected


def fake_gpus(monkeypatch, n, nccl=NEW):
    """Make this process see ``n`` GPUs and NCCL ``nccl`` (no CUDA call happens in planning)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(SHARE_ENV, raising=False)


def test_resolve_backend_is_the_plan(monkeypatch):
    fake_gpus(monkeypatch, 2)
    assert resolve_backend(4) == ("nccl", "cuda")
    fake_gpus(monkeypatch, 2, nccl=OLD)
    assert resolve_backend(4) == ("gloo", "cpu")
    assert resolve_backend(2) == ("nccl", "cuda")


@pytest.mark.parametrize(
    "gpus, nccl, ranks, size",
    [
        (0, None, None, "cpu"),
        (1, NEW, None, "gpu"),  # 4 ranks share the GPU
        (1, OLD, None, "cpu"),  # 4 ranks would run on the CPU, even though CUDA is there
        (1, OLD, 1, "gpu"),  # notebook 01: one process, on the GPU
        (4, OLD, 4, "gpu"),
        (4, OLD, 8, "cpu"),  # notebook 07's 8 ranks do not fit 4 GPUs with old NCCL
    ],
)
def test_the_size_follows_where_the_ranks_run(monkeypatch, gpus, nccl, ranks, size):
    monkeypatch.delenv(sizes.SIZE_ENV, raising=False)
    fake_gpus(monkeypatch, gpus, nccl)
    assert sizes.default_size_name(ranks) == size
    assert sizes.get_size(ranks=ranks).name == size
    assert sizes.hardware_line(ranks or 4).count(".") >= 2  # where, then the size


def test_course_size_still_wins(monkeypatch):
    fake_gpus(monkeypatch, 1, OLD)
    monkeypatch.setenv(sizes.SIZE_ENV, "gpu")
    assert sizes.get_size().name == "gpu"
    assert "COURSE_SIZE=gpu" in sizes.hardware_line(4)


def test_hardware_line_says_where_and_why(monkeypatch):
    monkeypatch.delenv(sizes.SIZE_ENV, raising=False)
    fake_gpus(monkeypatch, 1, OLD)
    line = sizes.hardware_line(4)
    assert line.startswith("4 ranks on the CPU with gloo")
    assert "NCCL 2.27.3 cannot share a GPU" in line
    assert "size 'cpu' (4 ranks, as many as the 'gpu' size starts, would run on the CPU" in line
    assert "the 8 ranks would run on the CPU" in sizes.hardware_line(8, chosen_for=8)


def test_two_gpus_and_old_nccl_the_line_explains_the_smaller_size(monkeypatch):
    """The gpu size's 4 ranks would run on the CPU, so the size is cpu; its 2 ranks fit the 2 GPUs.
    The line must say both, not a bare size."""
    monkeypatch.delenv(sizes.SIZE_ENV, raising=False)
    fake_gpus(monkeypatch, 2, OLD)
    size = sizes.get_size()
    assert size.name == "cpu" and size.world_size == 2
    line = sizes.hardware_line(size.world_size, size)
    assert line.startswith("2 ranks on 2 GPUs, one each, with nccl")
    assert "size 'cpu' (4 ranks, as many as the 'gpu' size starts, would run on the CPU" in line


def topo(local_rank, local_world_size):
    return cdist.Topology(local_rank, local_world_size, local_rank, local_world_size,
                          "127.0.0.1", 1, "torchrun", "t")  # fmt: skip


def test_scripts_place_ranks_as_launch_does(monkeypatch, capsys):
    fake_gpus(monkeypatch, 3)
    backend, device, env = cdist._pick_device(topo(3, 4), "auto")
    assert (backend, device, env) == ("nccl", torch.device("cuda", 0), {SHARE_ENV: "1"})
    backend, device, env = cdist._pick_device(topo(1, 2), "auto")
    assert (backend, device, env) == ("nccl", torch.device("cuda", 1), {})
    fake_gpus(monkeypatch, 3, OLD)  # torchrun with 4 ranks, old NCCL: CPU, said on local rank 0
    assert cdist._pick_device(topo(0, 4), "auto")[:2] == ("gloo", torch.device("cpu"))
    assert "4 ranks on the CPU with gloo" in capsys.readouterr().out
    with pytest.raises(ValueError, match="NCCL 2.27.3"):
        cdist._pick_device(topo(0, 4), "nccl")


def test_a_script_under_launch_keeps_the_launchers_placement(monkeypatch, tmp_path):
    """launch(script, device="cuda", backend="gloo") already put the rank on its GPU: dist.init()
    in the script must not plan again and land on the CPU."""
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("COURSE_BACKEND", "gloo")
    monkeypatch.setenv("COURSE_DEVICE", "cuda:0")
    assert cdist._pick_device(topo(1, 2), "gloo") == ("gloo", torch.device("cuda", 0), {})
    monkeypatch.delenv("COURSE_RUN_DIR")  # a stray variable outside launch is ignored
    assert cdist._pick_device(topo(1, 2), "gloo")[1] == torch.device("cpu")


CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130's list


def test_no_rank_on_a_gpu_the_build_has_no_kernels_for():
    """A V100 (sm_70) under the default cu130 build: launch refuses before any process starts,
    names the build that has its kernels and what that build's NCCL means; a T4 (sm_75) and an
    L4 (sm_89, through sm_86's cubin) are placed; device='cpu' still runs."""
    with pytest.raises(ValueError) as e:
        place_ranks(2, gpus=1, nccl=(2, 30, 7), env={}, rocm=False, capabilities=[(7, 0)],
             arch_list=CU130)  # fmt: skip
    msg = str(e.value)
    assert "sm_70" in msg and "kernels for sm_75 to sm_120 only" in msg
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cu126" in msg
    assert "older than 2.30" in msg and "device='cpu'" in msg
    for cap in ((7, 5), (8, 9)):
        p = place_ranks(2, gpus=2, nccl=(2, 30, 7), env={}, rocm=False, capabilities=[cap] * 2,
                 arch_list=CU130)  # fmt: skip
        assert p.device_type == "cuda"
    cpu = place_ranks(2, device="cpu", gpus=1, nccl=(2, 30, 7), env={}, rocm=False,
               capabilities=[(7, 0)], arch_list=CU130)  # fmt: skip
    assert cpu.device_type == "cpu"
    # the cu126 build keeps Volta's kernels
    old = place_ranks(1, gpus=1, nccl=(2, 27, 3), env={}, rocm=False, capabilities=[(7, 0)],
               arch_list=["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"])  # fmt: skip
    assert old.device_type == "cuda"
