"""The pre-flight report: verdict first, what failed named, nothing hidden."""

from course_utils.tooling.preflight import render


def report(**over):
    r = {
        "verdict": "PASS",
        "host": "gpu07",
        "date": "2026-11-23T10:00:00+00:00",
        "size": "gpu",
        "slurm_job": "123",
        "seconds": 600.0,
        "versions": {"python": "3.11", "torch": "2.14.1", "torchvision": "0.29.1",
                     "cuda_runtime": "13.0", "hip_runtime": None, "nccl": "2.27.7"},
        "hardware": {"platform": "Linux", "cpu_cores": 64, "interconnect": None,
                     "gpus": [{"name": "NVIDIA H100", "memory_gib": 79.2}] * 4},
        "data": {"cifar100": "present"},
        "data_dir": "/scratch/data",
        "checks": {"gpu": "ok", "all_reduce (nccl, 2 ranks)": "ok"},
        "collectives": {"world_size": 4, "rows": [
            {"op": "all_reduce", "bytes": 2**28, "time_us": 2000.0, "busbw_GBps": 201.3}]},
        "notebooks": [{"notebook": "01_single_gpu", "status": "ok", "seconds": 61.0, "error": ""}],
    }  # fmt: skip
    return {**r, **over}


def test_a_passing_report_says_so_and_gives_the_numbers():
    text = render(report())
    assert text.splitlines()[0] == "# Pre-flight of gpu07: PASS"
    assert "Everything passed." in text and "SLURM job 123" in text
    assert "4 x" not in text and text.count("NVIDIA H100, 79.2 GiB") == 4
    assert "bus bandwidth 201.30 GB/s" in text and "| 01_single_gpu | ok | 61 |" in text


def test_a_failing_report_names_every_failure_first():
    bad = report(
        verdict="FAIL",
        checks={"gpu": "ok", "all_reduce (nccl, 2 ranks)": "failed: RuntimeError: NCCL timeout"},
        notebooks=[
            {"notebook": "01_single_gpu", "status": "ok", "seconds": 61.0, "error": ""},
            {"notebook": "05_pipeline_parallel", "status": "FAILED", "seconds": 12.0,
             "error": "AssertionError: bubble"},
        ],
    )  # fmt: skip
    lines = render(bad).splitlines()
    assert lines[0].endswith(": FAIL")
    failed = next(line for line in lines if line.startswith("**Failed:**"))
    assert "all_reduce (nccl, 2 ranks)" in failed and "notebook 05_pipeline_parallel" in failed
    assert "notebook 01_single_gpu" not in failed
    assert any("FAILED: AssertionError: bubble" in line for line in lines)


def test_a_report_cut_off_says_so_and_keeps_what_ran():
    cut = report(verdict="INCOMPLETE", collectives={"rows": [], "status": "not run yet"})
    text = render(cut)
    assert text.splitlines()[0].endswith(": INCOMPLETE")
    assert "cut off" in text and "Everything passed." not in text
    assert "| 01_single_gpu | ok | 61 |" in text
