"""``bench tp`` end to end at a tiny size: the report's structure, and activation memory per rank
equal to Korthikanti et al.'s Table 2 (float32) plus the LayerNorms' statistics. Timing is not
checked."""

from __future__ import annotations

import json

import pytest

from course_utils.__main__ import main
from course_utils.bench import tp as bench_tp
from course_utils.tensor_parallel.measure import activation_bytes_per_layer

# make test-floor runs these on the oldest torch too: DTensor
pytestmark = [pytest.mark.floor]

TINY = {"d_model": 32, "n_heads": 4, "seq_len": 16, "batch": 2, "steps": 2, "warmup": 1}


@pytest.mark.multiprocess
def test_bench_tp_cli_reports_times_and_memory_equal_to_table2(runs_root, monkeypatch, capsys):
    monkeypatch.setattr(bench_tp, "DEFAULTS", TINY)
    assert main(["bench", "tp", "--world-sizes", "1", "2", "--rounds", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["world_sizes"] == [1, 2] and r["rounds"] == 1 and r["backend"] == "gloo"
    assert {"machine", "date"} <= set(r) and r["config"]["plan"] == bench_tp.PLAN
    one, two = r["rows"]
    assert one["t"] == 1 and set(one["samples_ms"]) == {"single"} and one["ratio"] is None
    assert two["t"] == 2 and set(two["samples_ms"]) == {"ours", "torch"}
    assert two["ratio"] == pytest.approx(
        two["median_step_ms"]["torch"] / two["median_step_ms"]["ours"]
    )
    s, b, h, a = TINY["seq_len"], TINY["batch"], TINY["d_model"], TINY["n_heads"]
    ln_stats = 2 * 2 * s * b * 4  # 2 LayerNorms keep a mean and a 1/std per token, float32
    for row in (one, two):
        t = row["t"]
        assert len(row["samples_ms"][next(iter(row["samples_ms"]))]) == 1
        # on the CPU, dropout keeps a float32 mask: 4 bytes per element
        want = activation_bytes_per_layer(s, b, h, a, t=t, act_bytes=4, mask_bytes=4)
        assert row["formula_bytes"] == {"table2": want, "layernorm_stats": ln_stats}
        assert row["activation_bytes"] == [want + ln_stats] * t
    text = bench_tp.table(r)
    assert "throughput ours / torch" in text and text.count("\n| ") == 4  # header, rule, 2 rows
    assert text.rstrip().endswith("| 0 |")  # measured - formula


def test_bench_tp_refuses_degrees_that_do_not_split_the_heads():
    with pytest.raises(ValueError, match="n_heads=4"):
        bench_tp.run(world_sizes=(1, 3), rounds=1, **TINY)
