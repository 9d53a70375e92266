"""doctor's GPU diagnosis, on recorded outputs of nvidia-smi and rocm-smi (tests/fixtures/gpu/).

The fixtures follow the tools' documented formats: nvidia-smi's default table of drivers 470
(CUDA 11.4), 535 (12.2) and 580 (13.0), its message when the driver is not loaded, and rocm-smi's
``--showproductname`` of a LUMI-G node (8 MI250X GCDs) and ``--showtopo`` of two GPUs.
"""

from pathlib import Path

import pytest

from course_utils.tooling.doctor import render
from course_utils.tooling.gpu_diagnosis import (
    Diagnosis,
    Probe,
    diagnose,
    parse_nvidia_smi,
    parse_rocm_smi,
)

FIX = Path(__file__).parent / "fixtures" / "gpu"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def test_nvidia_smi_tables_of_three_driver_generations():
    assert parse_nvidia_smi(fixture("nvidia-smi-470-v100x4.txt")) == {
        "driver": "470.182.03",
        "cuda": "11.4",
        "gpus": ["Tesla V100-SXM2..."] * 4,
    }
    assert parse_nvidia_smi(fixture("nvidia-smi-535-a100x2.txt")) == {
        "driver": "535.104.05",
        "cuda": "12.2",
        "gpus": ["NVIDIA A100-SXM4-40GB"] * 2,
    }
    h100 = parse_nvidia_smi(fixture("nvidia-smi-580-h100.txt"))
    assert h100["cuda"] == "13.0" and h100["gpus"] == ["NVIDIA H100 80GB HBM3"]


def test_rocm_smi_lists_every_gcd():
    assert parse_rocm_smi(fixture("rocm-smi-mi250x-lumi.txt")) == [str(i) for i in range(8)]


def nvidia(smi="nvidia-smi-535-a100x2.txt", **kw) -> Probe:
    base = dict(
        nvidia_smi=fixture(smi),
        dev_nodes=["/dev/nvidia0", "/dev/nvidia1"],
        torch_version="2.14.1+cu130",
        torch_cuda="13.0",
    )
    return Probe(**(base | kw))


def test_driver_older_than_torchs_cuda():
    d = diagnose(nvidia(cuda_warning="The NVIDIA driver on your system is too old"))
    assert (d.vendor, d.gpus, d.usable) == ("nvidia", 2, False)
    assert "driver 535.104.05 supports CUDA up to 12.2" in d.problem
    assert "CUDA 13.0, which needs a driver >= 580.65.06" in d.problem
    assert d.fix.startswith("make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126")


def test_cuda_11_driver_gets_the_cu118_index_with_a_release_it_has():
    d = diagnose(
        nvidia("nvidia-smi-470-v100x4.txt", torch_version="2.14.1+cu126", torch_cuda="12.6")
    )
    assert d.gpus == 4 and "supports CUDA up to 11.4" in d.problem
    assert d.fix.startswith(
        'make setup TORCH_INDEX=https://download.pytorch.org/whl/cu118 TORCH_PINS="torch==2.7.1'
    )


def test_a_failing_nvidia_smi_without_gpus_is_no_gpu():
    # a login node or a CPU image: the tool is installed, no device files, a CPU torch
    probe = nvidia("nvidia-smi-no-driver.txt", nvidia_smi_failed=True, dev_nodes=[])
    probe.torch_cuda = None
    assert diagnose(probe) == Diagnosis(None, 0, False)


def test_driver_problem_comes_before_the_build():
    d = diagnose(nvidia("nvidia-smi-no-driver.txt", nvidia_smi_failed=True, torch_cuda=None))
    assert "driver does not answer" in d.problem


def test_cpu_only_torch_on_an_nvidia_node():
    d = diagnose(nvidia(torch_version="2.14.1+cpu", torch_cuda=None))
    assert "CPU-only build" in d.problem and "cannot drive NVIDIA GPUs" in d.problem
    assert d.fix == "make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126"


def test_rocm_torch_on_an_nvidia_node():
    d = diagnose(nvidia("nvidia-smi-580-h100.txt", torch_cuda=None, torch_hip="6.4.43484"))
    assert "ROCm (AMD) build" in d.problem
    assert d.fix.endswith("whl/cu130")


def test_driver_not_loaded():
    d = diagnose(nvidia("nvidia-smi-no-driver.txt", nvidia_smi_failed=True))
    assert d.vendor == "nvidia" and not d.usable
    assert "couldn't communicate with the NVIDIA driver" in d.problem
    assert "not a course set-up problem" in d.fix


def test_hidden_by_cuda_visible_devices():
    d = diagnose(nvidia("nvidia-smi-580-h100.txt", visible={"CUDA_VISIBLE_DEVICES": ""}))
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in d.problem
    assert d.fix.startswith("unset CUDA_VISIBLE_DEVICES")


def test_usable_nvidia():
    d = diagnose(nvidia("nvidia-smi-580-h100.txt", cuda_available=True, device_count=1))
    assert d.usable and d.problem is None
    assert d.render() == ["GPU check: 1 NVIDIA GPU(s), usable from torch."]


def amd(**kw) -> Probe:
    base = dict(
        rocm_smi=fixture("rocm-smi-mi250x-lumi.txt"),
        rocm_version="6.2.4-120",
        dev_nodes=["/dev/kfd"],
        torch_version="2.14.1+cu130",
        torch_cuda="13.0",
    )
    return Probe(**(base | kw))


def test_cuda_torch_on_an_amd_node():
    d = diagnose(amd())
    assert (d.vendor, d.gpus, d.usable) == ("amd", 8, False)
    assert "CUDA (NVIDIA) build" in d.problem and "cannot drive AMD GPUs" in d.problem
    assert d.fix.startswith("make setup TORCH_INDEX=https://download.pytorch.org/whl/rocm6.2")
    assert "USE_SYSTEM_TORCH=1" in d.fix


def test_amd_without_a_known_rocm_release_says_where_to_read_it():
    d = diagnose(amd(rocm_version=None, torch_cuda=None))
    assert "CPU-only build" in d.problem
    assert "rocmX.Y" in d.fix and "/opt/rocm/.info/version" in d.fix


def test_no_permission_on_kfd():
    d = diagnose(amd(torch_cuda=None, torch_hip="6.2.41133", kfd_access=False))
    assert "/dev/kfd" in d.problem and "'render' and 'video' groups" in d.fix


def test_rocm_major_release_mismatch():
    d = diagnose(amd(torch_cuda=None, torch_hip="5.7.31921"))
    assert "built for ROCm 5.7.31921; the node has ROCm 6.2.4-120" in d.problem


def test_usable_amd_and_no_gpu_at_all():
    assert diagnose(
        amd(torch_cuda=None, torch_hip="6.2.41133", cuda_available=True, device_count=8)
    ).usable
    none = diagnose(Probe(torch_version="2.14.1+cu130", torch_cuda="13.0"))
    assert none == Diagnosis(None, 0, False)
    assert "no GPU on this node" in none.render()[0]


def report(**over) -> dict:
    info = {
        "python": "3.11.7",
        "platform": "Linux",
        "torch": "2.14.1+rocm6.4",
        "torchvision": "0.29.1",
        "torch_floor": "2.6",
        "torch_tested": "2.14.1",
        "cuda_runtime": None,
        "hip_runtime": "6.4.43484",
        "nccl": "2.22.3",
        "gpus": [],
        "gpu_check": vars(
            diagnose(amd(torch_cuda=None, torch_hip="6.4.4", cuda_available=True, device_count=2))
        ),
        "interconnect": ("rocm-smi --showtopo", fixture("rocm-smi-showtopo-2gpu.txt").strip()),
        "cpu_cores": 16,
        "cpu": {
            "described": "16 usable (128 in the machine, 128 in the affinity mask, a cgroup quota of 16 cores)"
        },
        "placement": {
            "4": "4 ranks on the CPU with gloo, 4 threads each: 2 GPUs for 4 ranks, and ..."
        },
        "compile": {
            "cpu": "ok",
            "cuda": "failed: RuntimeError: Cannot find a working triton installation",
        },
        "backends": {"gloo": True, "nccl": True, "mpi": False},
        "size": {
            "name": "gpu",
            "chosen_by": "auto",
            "train_samples": 1,
            "batch_size": 1,
            "width": 1,
            "world_size": 2,
        },
        "data_dir": "/d",
        "runs_dir": "/r",
        "data": {},
        "checks": {},
    }
    return info | over


def test_rocm_report_names_hip_rccl_and_rocm_smi_topology():
    text = render(report())
    assert "ROCm/HIP 6.4.43484, RCCL 2.22.3" in text
    assert "CUDA runtime" not in text
    assert "GPU interconnect (rocm-smi --showtopo):" in text and "XGMI" in text
    assert "the course needs torch >= 2.6" in text
    assert (
        "CPU cores: 16 usable (128 in the machine, 128 in the affinity mask, a cgroup quota" in text
    )
    assert "Ranks from launch():\n  4 ranks on the CPU with gloo" in text
    assert "torch.compile on cuda: failed: RuntimeError: Cannot find a working triton" in text


def test_report_warns_below_the_floor():
    assert "older than the course's floor" in render(report(torch="2.5.1+rocm6.2"))
    assert "older than the course's floor" not in render(report())


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.glob("nvidia-smi-*.txt")))
def test_every_nvidia_fixture_parses_or_is_the_failure_message(name):
    parsed = parse_nvidia_smi(fixture(name))
    assert parsed["driver"] or "failed" in fixture(name)


@pytest.mark.parametrize(
    "smi, torch_cuda, too_old",
    [
        ("nvidia-smi-535-a100x2.txt", "12.6", False),  # driver CUDA 12.2, torch 12.6: same major
        ("nvidia-smi-535-a100x2.txt", "12.2", False),  # exactly the driver's CUDA
        ("nvidia-smi-535-a100x2.txt", "13.0", True),  # one major release ahead
        ("nvidia-smi-580-h100.txt", "13.0", False),  # 580's CUDA 13.0 and a cu130 build
        ("nvidia-smi-580-h100.txt", "12.6", False),  # an older build on a newer driver
        ("nvidia-smi-470-v100x4.txt", "11.8", False),  # 470: CUDA 11.4, minor-version compatible
        ("nvidia-smi-470-v100x4.txt", "12.1", True),
    ],
)
def test_a_driver_of_the_same_cuda_major_is_not_too_old(smi, torch_cuda, too_old):
    """CUDA's minor-version compatibility: a build for CUDA M.x runs on any driver for M.0 or newer,
    so only a driver of an older *major* release is too old for torch's build."""
    d = diagnose(nvidia(smi, torch_cuda=torch_cuda, cuda_warning="CUDA unavailable"))
    said_too_old = "which needs a driver >=" in (d.problem or "")
    assert said_too_old is too_old, d.problem
    if not too_old:
        assert d.problem.startswith("torch (CUDA") and "found no usable GPU" in d.problem


CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130


def test_v100_under_the_cu130_build_has_no_kernels():
    """torch 2.14.1+cu130 carries kernels for sm_75 and newer: a V100 (sm_70) is visible and
    torch.cuda.is_available() says yes, but the first kernel fails. doctor says so and names the
    cu126 build, with what its older NCCL means for shared ranks."""
    probe = nvidia("nvidia-smi-580-h100.txt", cuda_available=True, device_count=1,
                   capabilities=[(7, 0)], gpu_names=["Tesla V100-SXM2-32GB"],
                   arch_list=CU130_ARCHS, nccl=(2, 30, 7))  # fmt: skip
    d = diagnose(probe)
    assert not d.usable
    assert "Tesla V100-SXM2-32GB (compute capability 7.0, sm_70)" in d.problem
    assert "kernels for sm_75 to sm_120 only" in d.problem and "no kernel image" in d.problem
    assert d.fix.startswith("make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126")
    assert "older than 2.30" in d.fix and "CPU ranks" in d.fix
    assert any(line.startswith("  fix: make setup") for line in d.render())


def test_t4_with_a_driver_older_than_580_is_told_what_its_build_means():
    """A T4 node on a CUDA 12.2 driver: the fix is the cu126 build, whose NCCL cannot share a
    GPU between ranks, and the doctor says so before the student starts."""
    d = diagnose(nvidia(cuda_warning="The NVIDIA driver on your system is too old"))
    assert d.fix.startswith("make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126")
    assert "older than 2.30, so ranks cannot share a GPU" in d.fix


@pytest.mark.parametrize(
    ("nccl", "words"),
    [((2, 30, 7), "runs several ranks on one GPU"), ((2, 27, 3), "cannot run several ranks")],
)
def test_usable_gpu_notes_what_the_nccl_means_for_shared_ranks(nccl, words):
    probe = nvidia("nvidia-smi-580-h100.txt", cuda_available=True, device_count=1,
                   capabilities=[(7, 5)], arch_list=CU130_ARCHS, nccl=nccl)  # fmt: skip
    d = diagnose(probe)
    assert d.usable and words in d.notes[0]
    assert d.render()[1].startswith("  note: ")


def test_mi250x_rocm_build_runs_one_rank_per_gcd():
    probe = amd(torch_cuda=None, torch_hip="6.2.41133", cuda_available=True, device_count=8,
                arch_list=["gfx90a", "gfx942"], capabilities=[(9, 0)] * 8, nccl=(2, 20, 5))  # fmt: skip
    d = diagnose(probe)
    assert d.usable and d.vendor == "amd"
    assert "RCCL runs one rank per GPU (on an MI250X, per GCD)" in d.notes[0]


def test_kernel_rules_of_cuda():
    from course_utils.tooling.gpu_diagnosis import has_kernels, parse_arch

    assert parse_arch("sm_90a") == ("sm", (9, 0)) and parse_arch("compute_120") == (
        "compute",
        (12, 0),
    )
    assert not has_kernels((7, 0), CU130_ARCHS)
    assert has_kernels((8, 9), CU130_ARCHS)  # sm_86's cubin runs on sm_89
    assert not has_kernels((9, 0), ["sm_80", "sm_86"])  # a cubin never runs on a newer major
    assert has_kernels((9, 0), ["sm_80", "compute_80"])  # PTX is compiled for it at load
    assert has_kernels((9, 0), ["gfx90a"])  # ROCm's list: nothing to compare
