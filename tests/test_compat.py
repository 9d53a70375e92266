"""The torch versions the course bridges (course_utils.compat): the boundaries, one by one."""

from __future__ import annotations

import pytest
import torch

from course_utils import compat

# make test-floor runs these on the oldest torch too: course_utils.compat, the bridge between versions
pytestmark = [pytest.mark.floor]


@pytest.mark.parametrize(
    "version, hangs",
    [
        ("2.5.1", True),  # below the floor: the same schedules, the same hang
        ("2.6.0", True),  # the floor: 1F1B and interleaved hang on gloo
        ("2.6.0+cpu", True),
        ("2.7.0", False),  # just above: fixed
        ("2.7.0a0+git1234", False),
        ("2.14.1", False),
    ],
)
def test_the_floors_hanging_1f1b_on_gloo(monkeypatch, version, hangs):
    monkeypatch.setattr(torch, "__version__", version)
    for schedule in ("1f1b", "interleaved"):
        why = compat.pipelining_unsupported(schedule, "gloo")
        assert (why is not None) == hangs, (version, schedule, why)
        if hangs:
            assert "hangs on gloo" in why and "torch 2.14.1 (make setup)" in why
    assert compat.pipelining_unsupported("gpipe", "gloo") is None  # GPipe works everywhere
    assert compat.pipelining_unsupported("1f1b", "nccl") is None  # and NCCL never hung


@pytest.mark.parametrize(
    "version, refused",
    [("2.6.0", True), ("2.6.0+cu124", True), ("2.7.0", False), ("2.14.1", False)],
)
def test_fsdp2_on_cpu_from_torch_2_7(monkeypatch, version, refused):
    monkeypatch.setattr(torch, "__version__", version)
    assert (compat.fsdp2_unsupported("cpu") is not None) == refused
    assert compat.fsdp2_unsupported("cuda") is None


@pytest.mark.parametrize("v, older", [("2.5.1", True), ("2.6.0", False), ("2.10.0", False)])
def test_older_than_the_floor_compares_numbers_not_strings(v, older):
    assert compat.older_than_floor(v) is older  # "2.10" < "2.6" as strings, not as versions
