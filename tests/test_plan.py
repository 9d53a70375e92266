"""The 3D planner (course_utils.plan): every number checked against arithmetic written out here,
independently of the code, and against Narayanan et al. 2021's Table 1. Single process, no GPU."""

from __future__ import annotations

import pytest

from course_utils.comm_model import AlphaBeta
from course_utils.models import GPT, Block, GPTConfig
from course_utils.plan import (
    A100_80GB,
    NARAYANAN_TABLE1,
    Choice,
    Cluster,
    Transformer,
    compare_narayanan,
    explain,
    fit_link,
    narayanan_model,
    placement,
    plan,
    predict,
    problems,
    shard_params,
    table,
    valid_choices,
)

# A small GPT whose numbers are easy by hand: L=4, h=64, a=4, s=32, V=128, B=8.
SMALL = Transformer(layers=4, hidden=64, heads=4, seq_len=32, vocab=128, global_batch=8)
# One layer: LayerNorms 4h + qkv (3h² + 3h) + proj (h² + h) + up (4h² + 4h) + down (4h² + h)
LAYER = (
    4 * 64 + (3 * 64 * 64 + 3 * 64) + (64 * 64 + 64) + (4 * 64 * 64 + 4 * 64) + (4 * 64 * 64 + 64)
)
assert LAYER == 49_984
PSI = 4 * LAYER + 128 * 64 + 32 * 64 + 2 * 64 + 64 * 128  # + embed, positions, ln_f, head
assert PSI == 218_496
BIG = Cluster(8, 1e15, 100e12, AlphaBeta(1e-6, 100e9), AlphaBeta(1e-5, 10e9), 0.5)  # never full


@pytest.mark.parametrize(
    "cfg",
    [
        GPTConfig(),
        GPTConfig(vocab=50, seq_len=12, d_model=48, n_heads=6, n_layers=3, ffn_mult=2),
    ],
)
def test_params_equal_the_course_gpt(cfg):
    model = Transformer.from_gpt_config(cfg, global_batch=4)
    assert model.params == sum(p.numel() for p in GPT(cfg).parameters())
    assert model.layer_params() == sum(p.numel() for p in Block(cfg).parameters())


def test_small_model_param_count_by_hand():
    assert SMALL.layer_params() == LAYER and SMALL.params == PSI
    assert shard_params(SMALL, 1, 1) == PSI
    # tp=2: the 12h² + 7h of qkv, proj, up and down weights (and qkv/up biases) are halved; the
    # LayerNorms (4h) and the row-parallel biases of proj and down (2h) stay whole.
    per_rank_layer = (12 * 64 * 64 + 7 * 64) / 2 + 6 * 64
    assert shard_params(SMALL, 1, 2) == 4 * per_rank_layer + 2 * 128 * 64 / 2 + 32 * 64 + 2 * 64
    # pp=2: the first stage (2 layers, embedding and positions) outweighs the last (2 layers,
    # final LayerNorm and head) by s·h - 2h
    assert shard_params(SMALL, 2, 1) == 2 * LAYER + 128 * 64 + 32 * 64


def test_memory_by_hand_plain_dp():
    pred = predict(SMALL, BIG, Choice(dp=2, pp=1, tp=1, zero=0, micro_batches=1))
    # ZeRO paper: (2 + 2 + K)Ψ with K = 12
    assert pred.memory["model_states"] == 16 * PSI
    # Korthikanti et al. 2022: sbh(34 + 5as/h) bytes per layer; b = 8 / 2 = 4
    sbh = 32 * 4 * 64
    assert pred.memory["activations"] == 4 * sbh * (34 + 5 * 4 * 32 / 64)
    assert pred.memory["total"] == 16 * PSI + 4 * sbh * 44
    # ZeRO-1/2/3 over dp = 2: 4Ψ + 12Ψ/2, 2Ψ + 14Ψ/2, 16Ψ/2
    for zero, want in [(1, 10 * PSI), (2, 9 * PSI), (3, 8 * PSI)]:
        assert predict(SMALL, BIG, Choice(2, 1, 1, zero)).memory["model_states"] == want


def test_memory_by_hand_pipeline_tensor_and_recompute():
    # pp=2, m=4: b = 8/4 = 2, the first stage keeps min(p, m) = 2 micro-batches of its 2 layers
    pred = predict(SMALL, BIG, Choice(dp=1, pp=2, tp=1, micro_batches=4))
    sbh = 32 * 2 * 64
    assert pred.memory["activations"] == 2 * 2 * sbh * 44
    assert pred.memory["model_states"] == 16 * (2 * LAYER + 128 * 64 + 32 * 64)
    # recomputation keeps 2·sbh bytes per layer and micro-batch, plus one layer being recomputed
    rec = predict(SMALL, BIG, Choice(1, 2, 1, micro_batches=4), recompute=True)
    assert rec.memory["activations"] == 2 * 2 * 2 * sbh + sbh * 44
    # m = 1 < p: only one micro-batch is ever in flight
    one = predict(SMALL, BIG, Choice(1, 2, 1, micro_batches=1))
    assert one.memory["activations"] == 2 * (32 * 8 * 64) * 44
    # tp=2 without sequence parallelism: sbh(10 + 24/t + 5as/(ht)) = 27·sbh per layer
    tp = predict(SMALL, BIG, Choice(dp=1, pp=1, tp=2, micro_batches=1))
    assert tp.memory["activations"] == 4 * (32 * 8 * 64) * (10 + 12 + 5)
    # with sequence parallelism everything is split: sbh(34/t + 5as/(ht)) = 22·sbh
    sp = predict(SMALL, BIG, Choice(1, 1, 2), sequence_parallel=True)
    assert sp.memory["activations"] == 4 * (32 * 8 * 64) * (17 + 5)


def test_fits_against_headroom():
    need = predict(SMALL, BIG, Choice(2, 1, 1)).memory["total"]
    tight = Cluster(8, need / 0.9 * 0.99, 1e12, AlphaBeta(0, 1e9), AlphaBeta(0, 1e9))
    pred = predict(SMALL, tight, Choice(2, 1, 1))
    assert not pred.fits
    assert "needs 0.0 GB per GPU" in pred.reasons[0] and "90% of" in pred.reasons[0]
    assert predict(SMALL, tight, Choice(2, 1, 1), memory_headroom=0.95).fits


def test_compute_bubble_and_communication_by_hand():
    row = NARAYANAN_TABLE1[0]  # 1.7B: L=24, h=2304, s=2048, V=51200, B=512
    model = narayanan_model(row)
    B, s, L, h, V = 512, 2048, 24, 2304, 51200
    rate = 312e12 * 0.5
    pred = predict(model, A100_80GB, Choice(dp=8, pp=4, tp=1, micro_batches=16))
    # Narayanan et al. 2021, eq. 3 without recomputation (72, V/12Lh) on 32 GPUs
    compute = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)) / (32 * rate)
    assert pred.time["compute"] == pytest.approx(compute, rel=1e-12)
    assert pred.time["bubble"] == pytest.approx(compute * 3 / 16, rel=1e-12)  # (p-1)/m
    rec = predict(model, A100_80GB, Choice(8, 4, 1, micro_batches=16), recompute=True)
    compute_rec = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)) / (32 * rate)
    assert rec.time["compute"] == pytest.approx(compute_rec, rel=1e-12)
    # pp: ranks pp_idx·8 + dp_idx lie on different nodes: 2(m + p - 2) messages of b·s·h·2 bytes
    b = 512 // (8 * 16)
    pp_msg = 10e-6 + b * s * h * 2 / 25e9
    assert pred.time["pp_comm"] == pytest.approx(2 * (16 + 4 - 2) * pp_msg, rel=1e-12)
    assert pred.time["tp_comm"] == 0.0
    # dp: ranks pp_idx·8 + dp_idx, one node per stage: a ring all-reduce of the first stage's
    # gradients (6 layers, embedding, positions) on NVLink
    psi = 6 * (12 * h * h + 13 * h) + V * h + s * h
    ring = 2 * 7 * 5e-6 + 2 * 7 / 8 * psi * 2 / 300e9
    assert pred.time["dp_comm"] == pytest.approx(ring, rel=1e-12)
    total = sum(pred.time[k] for k in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm"))
    assert pred.time["total"] == pytest.approx(total)


def test_tp_comm_by_hand():
    model = narayanan_model(NARAYANAN_TABLE1[3])  # L=40, h=6144, B=1024
    pred = predict(model, A100_80GB, Choice(dp=32, pp=1, tp=8, micro_batches=8))
    b, s, h = 1024 // (32 * 8), 2048, 6144
    # four all-reduces of b·s·h 2-byte values per layer and micro-batch, on NVLink, t=8
    ring = 2 * 7 * 5e-6 + 2 * 7 / 8 * b * s * h * 2 / 300e9
    assert pred.time["tp_comm"] == pytest.approx(4 * 40 * 8 * ring, rel=1e-12)
    rec = predict(model, A100_80GB, Choice(32, 1, 8, micro_batches=8), recompute=True)
    assert rec.time["tp_comm"] == pytest.approx(6 * 40 * 8 * ring, rel=1e-12)


def test_dp_comm_per_zero_stage():
    model = narayanan_model(NARAYANAN_TABLE1[2])
    t = {z: predict(model, A100_80GB, Choice(16, 1, 8, z)).time["dp_comm"] for z in range(4)}
    assert t[1] == pytest.approx(t[0]) and t[2] == pytest.approx(t[0])
    assert t[3] == pytest.approx(1.5 * t[0])  # ZeRO paper: 3Ψ against 2Ψ
    # with m = 4 micro-batches a sharded gradient is reduce-scattered after each of them, and
    # ZeRO-3 gathers the parameters for each forward and backward
    t4 = {z: predict(model, A100_80GB, Choice(16, 1, 8, z, 4)).time["dp_comm"] for z in range(4)}
    assert t4[0] == pytest.approx(t[0]) and t4[1] == pytest.approx(t[0])
    assert t4[2] == pytest.approx(t[0] / 2 * 4 + t[0] / 2)
    assert t4[3] == pytest.approx(4 * 1.5 * t[0])


def test_placement_16_gpus_8_per_node():
    assert placement(Choice(dp=2, pp=4, tp=2), 8) == {"tp": "intra", "dp": "intra", "pp": "inter"}
    assert placement(Choice(dp=2, pp=1, tp=8), 8) == {"tp": "intra", "dp": "inter", "pp": "intra"}
    assert placement(Choice(dp=1, pp=1, tp=16), 8)["tp"] == "inter"
    assert placement(Choice(dp=16, pp=1, tp=1), 8)["dp"] == "inter"
    assert placement(Choice(dp=1, pp=2, tp=8), 8) == {"tp": "intra", "dp": "intra", "pp": "inter"}


def test_invalid_choices_say_why_with_numbers():
    say = problems(SMALL, Choice(dp=2, pp=4, tp=2), n_gpus=8)
    assert say == ["dp=2 × pp=4 × tp=2 = 16, but n_gpus is 8"]
    assert "heads=4 is not divisible by tp=8" in problems(SMALL, Choice(1, 1, 8))
    assert "layers=4 < pp=8: a stage would have no layer" in problems(SMALL, Choice(1, 8, 1))
    odd_vocab = Transformer(4, 64, 4, 32, 130, 8)
    assert "vocab=130 is not divisible by tp=4" in problems(odd_vocab, Choice(2, 1, 4))
    say = problems(SMALL, Choice(dp=2, pp=1, tp=1, micro_batches=3))
    assert say == ["global batch 8 is not divisible by dp=2 × m=3 = 6"]
    pred = predict(SMALL, BIG, Choice(2, 1, 1, micro_batches=3))
    assert not pred.fits and pred.reasons == say
    with pytest.raises(ValueError, match="not divisible by dp=2 × m=3 = 6"):
        Choice(2, 1, 1, micro_batches=3).micro_batch_size(SMALL)
    assert Choice(2, 1, 1, micro_batches=2).micro_batch_size(SMALL) == 2
    with pytest.raises(ValueError, match="zero must be 0, 1, 2 or 3"):
        Choice(1, 1, 1, zero=4)
    with pytest.raises(ValueError, match="hidden=60 must be a multiple of heads=8"):
        Transformer(2, 60, 8, 16, 64, 4)


def test_valid_choices_on_8_gpus():
    # tp ∈ {1, 2, 4} (heads = 4), pp ≤ 4 layers, m dividing B/dp = 8/dp
    shapes = {
        (8, 1, 1): [1],
        (4, 2, 1): [1, 2],
        (2, 4, 1): [1, 2, 4],
        (4, 1, 2): [1, 2],
        (2, 2, 2): [1, 2, 4],
        (1, 4, 2): [1, 2, 4, 8],
        (2, 1, 4): [1, 2, 4],
        (1, 2, 4): [1, 2, 4, 8],
    }
    want = {Choice(d, p, t, 0, m) for (d, p, t), ms in shapes.items() for m in ms}
    got = valid_choices(SMALL, 8, zero_stages=(0,))
    assert len(got) == len(want) == 22 and set(got) == want
    # ZeRO 1-3 only where there is a dp > 1 to shard over: 14 × 4 + 8
    assert len(valid_choices(SMALL, 8)) == 64
    assert {c.micro_batches for c in valid_choices(SMALL, 8, micro_batches=[2])} == {2}


def test_plan_ranks_fitting_first_then_by_time():
    model = narayanan_model(NARAYANAN_TABLE1[2])  # 7.5B on 16 GPUs: some layouts fit, some not
    preds = plan(model, A100_80GB, 16)
    fits = [p.fits for p in preds]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)
    times = [p.time["total"] for p in preds if p.fits]
    assert times == sorted(times)
    assert all(p.choice.n_gpus == 16 for p in preds)
    with pytest.raises(ValueError, match="no layout of 7 GPUs"):
        plan(Transformer(2, 64, 4, 32, 128, 8), A100_80GB, 7)


def test_explain_and_table():
    model = narayanan_model(NARAYANAN_TABLE1[2])
    text = explain(predict(model, A100_80GB, Choice(2, 4, 2, 1, 64)), model, A100_80GB)
    assert "TP=2 stays inside a node on NVLink" in text
    assert "PP=4 across nodes" in text and "DP=2 over the rest, inside a node" in text
    wide = explain(predict(model, A100_80GB, Choice(1, 1, 16, 0, 512)), model, A100_80GB)
    assert "TP=16 crosses nodes (tp=16 > 8 GPUs per node)" in wide
    # b = 4 on tp=4: 31 GB of replicated states + 44 GB of activations > 72 GB; ZeRO-1 fits
    sharded = explain(predict(model, A100_80GB, Choice(32, 1, 4, 1, 4)), model, A100_80GB)
    assert "ZeRO-1 (P_os) because with less sharding the states would not fit" in sharded
    assert "(ZeRO-0 30.8 GB); sharded over dp=32 they take 8.4 GB" in sharded
    replicated = explain(predict(model, A100_80GB, Choice(32, 1, 4, 0, 16)), model, A100_80GB)
    assert "ZeRO off: the replicated model states (30.8 GB) fit" in replicated
    md = table(plan(SMALL, BIG, 8), limit=3).splitlines()
    assert md[0].startswith("| dp | pp | tp | zero | m | b | memory GB | step s | compute")
    assert len(md) == 2 + 3


def test_fit_link_recovers_alpha_beta():
    alpha, beta, n = 7e-6, 40e9, 4
    sizes = [1 << k for k in range(10, 27, 2)]
    ring = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    rows = [
        {"op": op, "bytes": m, "time_us": 1e6 * (k * (n - 1) * alpha + k * (n - 1) / n * m / beta)}
        for op, k in ring.items()
        for m in sizes
    ]
    report = {"rows": rows, "world_size": n, "backend": "nccl", "unsupported": {}}
    for op in ring:
        link = fit_link(report, op)
        assert link.alpha == pytest.approx(alpha, rel=0.01)
        assert link.beta == pytest.approx(beta, rel=0.01)
    with pytest.raises(ValueError, match="0 all_reduce row"):
        fit_link({"rows": [], "world_size": 2}, "all_reduce")
    with pytest.raises(ValueError, match="1 rank"):
        fit_link({"rows": rows, "world_size": 1})


def test_compare_narayanan_table1():
    rows = compare_narayanan()
    assert len(rows) == len(NARAYANAN_TABLE1) == 10
    for row, paper in zip(rows, NARAYANAN_TABLE1):
        assert (row["paper_t"], row["paper_p"], row["gpus"]) == (
            paper["t"],
            paper["p"],
            paper["gpus"],
        )
        # Takeaway #1 of the paper, and memory: TP never leaves a node, the choice fits in 80 GB
        assert row["t"] <= A100_80GB.gpus_per_node
        assert row["fits"] and row["memory_gb"] <= 0.9 * 80
        assert row["t"] * row["p"] * row["dp"] == row["gpus"] and row["why"]
        # our prediction for the paper's own layout is within 30% of the step time it measured
        assert 0.7 < row["paper_layout_step_s"] / row["paper_measured_step_s"] < 1.3
    for row in rows[5:]:  # 76B and up: like the paper, TP fills the node and PP spans nodes
        assert row["t"] == 8 and row["p"] > 1


def test_pipeline_messages_shrink_by_t_with_sequence_parallelism():
    """With SP the activation at a stage boundary is split along the sequence: each of the t ranks
    of a stage sends b·s·h/t values to its peer in the next stage, not b·s·h."""
    model = Transformer(layers=8, hidden=1024, heads=16, seq_len=512, vocab=1024, global_batch=16)
    c = Choice(dp=1, pp=2, tp=4, micro_batches=8)  # b = 16 / 8 = 2
    b, s, h, m, p = 2, 512, 1024, 8, 2
    link = BIG.intra  # dp·pp·tp = 8 GPUs: one node of BIG, every link inside it
    plain = predict(model, BIG, c).time["pp_comm"]
    sp = predict(model, BIG, c, sequence_parallel=True).time["pp_comm"]
    messages = 2 * (m + p - 2)  # forward activations and backward gradients, as 1F1B sends them
    assert plain == pytest.approx(messages * (link.alpha + b * s * h * 2 / link.beta), rel=1e-12)
    assert sp == pytest.approx(messages * (link.alpha + b * s * h * 2 / 4 / link.beta), rel=1e-12)


def test_the_fullest_stage_sets_the_compute_time():
    """L = 10 layers on p = 4 stages: the fullest stage has ceil(10/4) = 3 layers, and the others
    wait for it, so compute takes 3·4/10 = 1.2 times the evenly divided share."""
    model = Transformer(layers=10, hidden=256, heads=8, seq_len=128, vocab=512, global_batch=8)
    B, s, L, h, V = 8, 128, 10, 256, 512
    flops = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    pred = predict(model, BIG, Choice(dp=2, pp=4, tp=1, micro_batches=4))  # 8 GPUs of BIG at 50%
    assert pred.detail["layers_per_stage"] == 3
    assert pred.time["compute"] == pytest.approx(flops / (8 * 50e12) * 1.2, rel=1e-12)
    five = predict(model, BIG, Choice(dp=1, pp=5, tp=1, micro_batches=8))  # 5 divides 10: even
    assert five.time["compute"] == pytest.approx(flops / (5 * 50e12), rel=1e-12)
