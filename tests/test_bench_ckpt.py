"""``bench ckpt`` end to end at a tiny size: the report's structure, bytes per rank against the
tensors each rank holds, loads that restore the saved values, stalls measured for both saves (as excess over a round without a save), and
the checkpoint folder removed afterwards. Which save is faster is not checked."""

from __future__ import annotations

import json

import pytest

from course_utils.__main__ import main
from course_utils.bench import ckpt as bench_ckpt
from course_utils.compat import fsdp2_unsupported

pytestmark = pytest.mark.skipif(
    bool(fsdp2_unsupported("cpu")), reason=str(fsdp2_unsupported("cpu"))
)

# headers per tensor in the files: torch.save's zip records (course), DCP's per-item torch.save;
# DCP also writes the replicated 0-d Adam steps once, on a rank of its choosing
PER_TENSOR = {"sharded": 512, "dcp": 2048}


def test_width_for_gives_the_state_asked_for():
    w = bench_ckpt.width_for(24.0)
    assert w % 8 == 0
    assert 3 * 4 * bench_ckpt.LAYERS * (w * w + w) == pytest.approx(24e6, rel=0.03)


def test_conclude_claims_only_what_the_ranges_allow():
    assert "below" in bench_ckpt.conclude([1, 2], [3, 4], "a", "b")
    assert "above" in bench_ckpt.conclude([5, 6], [3, 4], "a", "b")
    assert "overlap" in bench_ckpt.conclude([1, 3.5], [3, 4], "a", "b")


def test_steps_to_outlast_a_save_stay_within_their_bounds():
    """A save that takes no time needs the fewest steps; one far longer than a step, the most."""
    import time

    from course_utils.checkpoint.dcp import steps_to_outlast_a_save

    assert steps_to_outlast_a_save(lambda: None, lambda: time.sleep(0.01), "cpu") == 3
    assert steps_to_outlast_a_save(lambda: time.sleep(0.05), lambda: None, "cpu") == 50
    k = steps_to_outlast_a_save(lambda: None, lambda: None, "cpu", at_least=7, at_most=9)
    assert 7 <= k <= 9


@pytest.mark.multiprocess
def test_bench_ckpt_cli_reports_bytes_loads_and_stalls(runs_root, tmp_path, capsys):
    where = tmp_path / "checkpoints"
    where.mkdir()
    argv = ["bench", "ckpt", "--world-sizes", "2", "--rounds", "1", "--mb", "0.2",
            "--dir", str(where), "--json"]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["world_sizes"] == [2] and r["rounds"] == 1 and r["backend"] == "gloo"
    assert list(where.iterdir()) == []  # the checkpoints are removed
    (row,) = r["rows"]
    held, n = row["held_bytes_per_rank"], row["tensors_per_rank"]
    # FSDP2 halves every tensor: each rank holds half the state, Adam's 0-d steps aside
    assert len(held) == 2 and sum(held) == pytest.approx(r["config"]["state_bytes"], rel=0.01)
    for m in bench_ckpt.METHODS:
        d = row[m]
        assert len(d["bytes_per_rank"]) == 2, m
        for on_disk, h in zip(d["bytes_per_rank"], held):
            # the files hold this rank's tensors and only them, up to headers
            assert 0 < on_disk - h + 64 < PER_TENSOR[m] * (n + 8), (m, on_disk, h)
        assert d["load_max_diff"] == 0.0, m  # zeroed tensors, every value restored
        assert len(d["save_s"]) == len(d["load_s"]) == 1 and min(d["save_s"] + d["load_s"]) > 0
    assert len(row["sync"]) == len(row["async"]) == len(row["async_call"]) == 1
    assert 3 <= row["steps_after"] <= 50  # as many steps as outlast a sync save, within bounds
    assert len(row["none_round"]) == 1 and row["none_round"][0] > 0
    # a stall is the round's excess over the no-save round: the async round holds its call
    assert row["async"][0] + row["none_round"][0] >= row["async_call"][0] > 0
    text = bench_ckpt.table(r)
    assert text.count("\n| 2 | ") == 3 and "P=2: stall, async / sync " in text
