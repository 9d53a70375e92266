"""``bench cp`` and ``bench moe`` end to end at a tiny size: the reports' structure, the values
each method sends equal to the formulas (cp) and to what the collectives had to move (moe).
Timing is not checked."""

from __future__ import annotations

import json

import pytest

from course_utils.__main__ import main
from course_utils.bench import cp as bench_cp
from course_utils.bench import moe as bench_moe
from course_utils.context_parallel import values_per_rank


@pytest.mark.multiprocess
def test_bench_cp_reports_every_method_and_sends_what_the_formulas_say(
    runs_root, monkeypatch, capsys
):
    tiny = {"batch": 1, "heads": 2, "seq_len": 16, "head_dim": 4, "steps": 1, "warmup": 0}
    monkeypatch.setattr(bench_cp, "DEFAULTS", tiny)
    assert main(["bench", "cp", "--world-sizes", "2", "--rounds", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [(row["method"], row["P"]) for row in r["rows"]] == [
        ("single", 1), ("ring", 2), ("ring-zigzag", 2), ("ulysses", 2)
    ]  # fmt: skip
    for row in r["rows"]:
        assert row["sent_values"] == row["formula_values"], row
    ring = values_per_rank("ring", 1, 16, 8, 2)
    assert r["rows"][1]["formula_values"] == ring["forward"] + ring["backward"] > 0
    assert "| ring-zigzag | 2 |" in bench_cp.table(r)
    with pytest.raises(ValueError, match="must divide heads=2"):
        bench_cp.run((4,), 1, **tiny)


@pytest.mark.multiprocess
def test_bench_moe_reports_ep_and_replicated_with_their_traffic(runs_root, monkeypatch, capsys):
    tiny = {"d_model": 8, "n_experts": 4, "top_k": 2, "ffn_mult": 2, "tokens": 16, "steps": 1,
            "warmup": 0}  # fmt: skip
    monkeypatch.setattr(bench_moe, "DEFAULTS", tiny)
    assert main(["bench", "moe", "--world-sizes", "2", "--rounds", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    rows = {(row["way"], row["n"]): row for row in r["rows"]}
    assert set(rows) == {("single", 1), ("ep", 2), ("replicated", 2)}
    h, E, f = 8, 4, 2
    params = h * E + E * (h * f * h + f * h + f * h * h + h)  # router, then each expert's MLP
    assert rows["replicated", 2]["sent_values"] == params  # 2(n-1)/n = 1 of every gradient at n=2
    assert rows["single", 1]["sent_values"] == 0
    assert sum(rows["ep", 2]["rows_per_rank"]) == 2 * 16 * 2  # every token's k rows, both ranks
    assert rows["ep", 2]["sent_values"] > 0
    assert "| replicated | 2 |" in bench_moe.table(r)
    with pytest.raises(ValueError, match="n_experts=4"):
        bench_moe.run((3,), 1, **tiny)
