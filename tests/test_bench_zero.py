"""``bench zero`` end to end at a tiny size: the report's structure, model states per rank equal to
the ZeRO formulas, and the bytes each stage sends. Timing is not checked."""

from __future__ import annotations

import json

import pytest

from course_utils.__main__ import main
from course_utils.bench import zero as bench_zero
from course_utils.compat import fsdp2_unsupported

# make test-floor runs these on the oldest torch too: FSDP2
pytestmark = [pytest.mark.floor]

TINY = {"vocab": 64, "seq_len": 16, "d_model": 32, "n_heads": 4, "n_layers": 2,
        "batch_per_rank": 2, "steps": 1, "warmup": 1}  # fmt: skip


@pytest.mark.multiprocess
def test_bench_zero_cli_reports_times_memory_and_bytes(runs_root, monkeypatch, capsys):
    monkeypatch.setattr(bench_zero, "DEFAULTS", TINY)
    assert main(["bench", "zero", "--world-sizes", "2", "--rounds", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["world_sizes"] == [2] and r["rounds"] == 1 and r["backend"] == "gloo"
    rows = {row["method"]: row for row in r["rows"]}
    why = fsdp2_unsupported("cpu")  # torch 2.6: FSDP2 has no CPU path, and the report says so
    expected = [m for m in bench_zero.METHODS if not (why and m == "fsdp2")]
    assert list(rows) == expected and r["skipped"] == ({"fsdp2": why} if why else {})
    for m, row in rows.items():
        assert len(row["samples_ms"]) == 1 and row["median_ms"] > 0
        # float32 Adam: measured within 1% of the formula (padding, Adam's step counters)
        assert row["states_bytes"] == pytest.approx(row["formula_bytes"], rel=0.01), (m, row)
    assert rows["zero1"]["volume_per_psi"] == pytest.approx(2.0)
    assert rows["zero1-naive"]["volume_per_psi"] == pytest.approx(3.0)
    assert rows["zero2"]["volume_per_psi"] == pytest.approx(2.0)
    # the root unit (embeddings, final LayerNorm, head) stays gathered from forward to backward
    assert 2.0 < rows["zero3"]["volume_per_psi"] < 3.0
    assert (
        rows["zero3"]["states_bytes"] < rows["zero2"]["states_bytes"] < rows["ddp"]["states_bytes"]
    )
    text = bench_zero.table(r)
    assert text.count("\n| 2 |") == len(expected)
    if why:
        assert bench_zero.ratio(r, 2) is None and f"fsdp2 not run: {why}" in text
    else:
        assert "ZeRO-3 / FSDP2" in text
        assert bench_zero.ratio(r, 2) == pytest.approx(
            rows["fsdp2"]["median_ms"] / rows["zero3"]["median_ms"]
        )
