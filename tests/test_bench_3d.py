"""``bench 3d`` end to end at a tiny size: calibration, every row's structure, and the planner's
memory prediction within 10% of the bytes counted in the ranks (counts, not timings: deterministic).
Step times are reported, never asserted."""

from __future__ import annotations

import pytest

from course_utils.bench import threed

# make test-floor runs these on the oldest torch too: pipelining and FSDP2
pytestmark = [pytest.mark.floor]

TINY = {"vocab": 64, "seq_len": 16, "d_model": 64, "n_heads": 4, "n_layers": 4, "dropout": 0.1,
        "global_batch": 8, "micro_batches": 2, "steps": 1, "warmup": 1}  # fmt: skip


def test_shapes_are_every_valid_layout_of_8_ranks():
    got = threed.shapes(TINY)
    assert (2, 2, 2) in got and (1, 1, 8) not in got  # tp=8 does not divide 4 heads
    assert all(dp * pp * tp == 8 and pp <= 4 and 4 % tp == 0 for dp, pp, tp in got)
    assert (4, 2, 1) in got and (8, 1, 1) not in got  # dp=8 × m=2 does not divide the batch of 8


@pytest.mark.multiprocess
@pytest.mark.slow  # 40-50 s; the floor runs the 3D parity tests instead
def test_bench_3d_memory_within_10_percent_of_the_planner(runs_root):
    r = threed.run(rounds=1, only=[(2, 2, 2), (1, 4, 2), (4, 1, 2)], **TINY)
    cal = r["calibration"]
    assert cal["alpha"] >= 0 and cal["beta"] > 0 and cal["flops_per_rank"] > 0
    assert [(row["dp"], row["pp"], row["tp"]) for row in r["rows"]] == [
        (2, 2, 2),
        (1, 4, 2),
        (4, 1, 2),
    ]
    for row in r["rows"]:
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
        assert abs(row["memory_error"]) <= 0.10, row
        # model states: float32 parameters and gradients, SGD without state: exactly 8 bytes each
        assert row["measured_states"] == pytest.approx(row["predicted_states"], rel=0.02), row
    text = threed.table(r)
    assert text.count("\n| ") == 2 + len(r["rows"]) and "memory 3/3 (±10%)" in text
