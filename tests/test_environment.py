"""The environment files agree, sizes validate, and the CLI answers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from course_utils.sizes import PRESETS, Size, get_size

ROOT = Path(__file__).resolve().parents[1]


def pip_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def conda_pins() -> dict[str, str]:
    text = (ROOT / "environment.yml").read_text()
    return {
        m[0].lower(): m[1] for m in re.findall(r"^\s+- ([A-Za-z0-9_.-]+)==(\S+)\s*$", text, re.M)
    }


def test_requirements_and_environment_yml_pin_the_same_versions():
    pip, conda = pip_pins(), conda_pins()
    assert pip == conda
    assert pip["torch"] == "2.14.1" and pip["torchvision"] == "0.29.1"


def test_pyproject_ranges_admit_the_pins():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = pip_pins()
    for dep in deps:
        req = Requirement(dep)
        assert req.specifier.contains(pins[req.name.lower()]), (dep, pins[req.name.lower()])


def test_ci_calls_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_sizes_select_and_validate(monkeypatch):
    monkeypatch.setenv("COURSE_SIZE", "ci")
    assert get_size().name == "ci"
    assert get_size("gpu").width > get_size("cpu").width > get_size("ci").width
    monkeypatch.setenv("COURSE_SIZE", "huge")
    with pytest.raises(ValueError, match="choose one of"):
        get_size()
    with pytest.raises(ValueError, match="batch_size=64 exceeds train_samples=10"):
        Size(**{**PRESETS["ci"].asdict(), "train_samples": 10})


def test_doctor_json_reports_a_working_gloo():
    out = subprocess.run(
        [sys.executable, "-m", "course_utils", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    info = json.loads(out.stdout)
    assert info["checks"]["gloo"]["all_reduce"] == "ok"
    assert info["cpu_cores"] >= 1 and info["size"]["name"] in PRESETS
    assert info["cpu"]["usable"] == info["cpu_cores"] <= info["cpu"]["affinity"]
    assert info["compile"]["cpu"] == "ok"  # a C++ compiler is here: Inductor works
    assert info["placement"]["4"].startswith("4 ranks on")
    assert set(info["data"]) == {"cifar10", "cifar100", "fashionmnist"}
