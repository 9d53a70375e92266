"""The 3D planner (course_utils.plan): every term checked against arithmetic written out here,
independently of the code, and the whole against published runs: Megatron-LM's Table 1
(Narayanan et al. 2021), the ZeRO paper's Table 1, the Ultra-Scale Playbook's memory formulas,
and the layouts of public training configurations. Single process, no GPU."""

from __future__ import annotations

import math

import pytest

from course_utils.comm_model import AlphaBeta
from course_utils.models import GPT, Block, GPTConfig
from course_utils.plan import (
    A100_80GB,
    GPT3_175B,
    H100_80GB,
    LLAMA3_8B,
    LLAMA3_70B,
    NARAYANAN_TABLE1,
    PUBLISHED_RUNS,
    Choice,
    Cluster,
    Transformer,
    compare_narayanan,
    explain,
    fit_link,
    flops_per_step,
    layer_activation_bytes,
    measured_step_s,
    narayanan_model,
    paper_layout,
    placement,
    plan,
    predict,
    problems,
    shard_params,
    table,
    valid_choices,
)

# A small GPT whose numbers are easy by hand: L=4, h=64, a=4, s=32, V=128, B=8 (no padding).
SMALL = Transformer(layers=4, hidden=64, heads=4, seq_len=32, vocab=128, global_batch=8,
                    vocab_multiple=1)  # fmt: skip
# One layer: LayerNorms 4h + qkv (3h² + 3h) + proj (h² + h) + up (4h² + 4h) + down (4h² + h)
LAYER = (
    4 * 64 + (3 * 64 * 64 + 3 * 64) + (64 * 64 + 64) + (4 * 64 * 64 + 4 * 64) + (4 * 64 * 64 + 64)
)
assert LAYER == 49_984
PSI = 4 * LAYER + 128 * 64 + 32 * 64 + 2 * 64 + 64 * 128  # + embed, positions, ln_f, head
assert PSI == 218_496
BIG = Cluster(8, 1e15, 100e12, AlphaBeta(1e-6, 100e9), AlphaBeta(1e-5, 10e9), 0.5)  # never full
# The 2021 GPT as Korthikanti et al. count it: scores materialised, no recomputation, no overlap
PLAIN = {"attention": "materialized", "sequence_parallel": False, "overlap": False,
         "pp_scatter_gather": False}  # fmt: skip


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


def test_params_of_published_models():
    """Llama 3 8B and 70B (SwiGLU of 14,336 / 28,672, 8 KV heads, untied, no biases): 8.03 B and
    70.55 B as Meta's model cards say; GPT-3 (tied, learned positions): 174.6 B."""
    assert LLAMA3_8B.params == pytest.approx(8.03e9, rel=2e-3)
    assert LLAMA3_70B.params == pytest.approx(70.55e9, rel=2e-3)
    assert GPT3_175B.params == pytest.approx(174.6e9, rel=2e-3)
    # 8B by hand: per layer 2h² (Q, O) + 2·h·(8·128) (K, V) + 3·h·14336 (gate, up, down) + 2h
    h = 4096
    layer = 2 * h * h + 2 * h * 1024 + 3 * h * 14336 + 2 * h
    assert LLAMA3_8B.layer_params() == layer
    assert LLAMA3_8B.params == 32 * layer + 2 * 128256 * h + h


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


def test_vocabulary_padded_as_megatron_so_it_never_forbids_a_t():
    m = Transformer(layers=4, hidden=64, heads=4, seq_len=32, vocab=130, global_batch=8)
    assert [m.padded_vocab(t) for t in (1, 2, 4)] == [256, 256, 512]  # multiples of 128·t
    assert problems(m, Choice(2, 1, 4)) == []  # 130 is not divisible by 4, padded it is
    unpadded = Transformer(4, 64, 4, 32, 130, 8, vocab_multiple=1)  # the course's own GPT
    assert "vocab=130 is not divisible by tp=4" in problems(unpadded, Choice(2, 1, 4))
    # the head and embedding shards hold the padded rows: V_pad·h/t each
    assert shard_params(m, 1, 4) - shard_params(unpadded, 1, 4) == 2 * (512 - 130) * 64 / 4


def test_swiglu_any_width_and_grouped_query_attention():
    m = Transformer(layers=2, hidden=64, heads=8, kv_heads=2, ffn_hidden=176, gated=True,
                    seq_len=16, vocab=100, global_batch=4, bias=False, dropout=False,
                    position_embeddings=False)  # fmt: skip
    kvd = 2 * 8  # 2 KV heads of head_dim 8
    assert m.matmul_params() == 2 * 64 * 64 + 2 * 64 * kvd + 3 * 64 * 176
    assert "ffn=176 is not divisible by tp=32" in problems(m, Choice(1, 1, 32))
    assert "kv_heads=2 is not divisible by tp=4" in problems(m, Choice(1, 1, 4))
    # forward FLOPs of a layer: 2 per weight per token, plus 4·s²·h per sequence
    B, s = 4, 16
    fwd = 2 * m.matmul_params() * B * s + 4 * B * s * s * 64
    logits = 6 * B * s * 64 * 100
    assert flops_per_step(m) == 2 * 3 * fwd + logits
    # activations: Q + K + V with 2 of 8 heads for K and V: (1 + 2·2/8)·sbh; SwiGLU 3·ffn/h
    sbh = s * 1 * 64
    want = 4 * 2 * sbh + ((1 + 0.5) * 2 * sbh + 2 * sbh + 3 * 176 / 64 * 2 * sbh)
    assert layer_activation_bytes(m, b=1) == pytest.approx(want)


def test_memory_by_hand_plain_dp():
    pred = predict(SMALL, BIG, Choice(dp=2, pp=1, tp=1, zero=0, micro_batches=1), **PLAIN)
    # ZeRO paper: (2 + 2 + K)Ψ with K = 12
    assert pred.memory["model_states"] == 16 * PSI
    # Korthikanti et al. 2022: sbh(34 + 5as/h) bytes per layer; b = 8 / 2 = 4; the last (only)
    # stage also keeps one micro-batch's logits in fp32, b·s·V·4 bytes
    sbh = 32 * 4 * 64
    logits = 4 * 4 * 32 * 128
    assert pred.memory["activations"] == 4 * sbh * (34 + 5 * 4 * 32 / 64) + logits
    # ZeRO-1/2 over dp = 2: 4Ψ + 12Ψ/2, 2Ψ + 14Ψ/2; ZeRO-3: 16Ψ/2 plus one layer gathered
    # with its gradient (2 + 2 bytes per parameter of a layer)
    for zero, want in [(1, 10 * PSI), (2, 9 * PSI), (3, 8 * PSI + 4 * LAYER)]:
        got = predict(SMALL, BIG, Choice(2, 1, 1, zero), **PLAIN).memory["model_states"]
        assert got == want


def test_memory_by_hand_pipeline_tensor_flash_and_recompute():
    # pp=2, m=4: b = 8/4 = 2, the first stage keeps min(p, m) = 2 micro-batches of its 2 layers
    pred = predict(SMALL, BIG, Choice(dp=1, pp=2, tp=1, micro_batches=4), **PLAIN)
    sbh = 32 * 2 * 64
    assert pred.detail["activations_first"] == 2 * 2 * sbh * 44
    assert pred.memory["model_states"] == 16 * (2 * LAYER + 128 * 64 + 32 * 64)
    # full recomputation keeps 2·sbh bytes per layer and micro-batch, plus one layer being
    # recomputed
    rec = predict(SMALL, BIG, Choice(1, 2, 1, micro_batches=4), recompute="full", **PLAIN)
    assert rec.detail["activations_first"] == 2 * 2 * 2 * sbh + sbh * 44
    # FlashAttention or selective recomputation: the 5as/h of the scores are never kept
    flash = predict(SMALL, BIG, Choice(1, 2, 1, micro_batches=4),
                    **{**PLAIN, "attention": "flash"})  # fmt: skip
    sel = predict(SMALL, BIG, Choice(1, 2, 1, micro_batches=4), recompute="selective", **PLAIN)
    assert flash.detail["activations_first"] == sel.detail["activations_first"] == 2 * 2 * sbh * 34
    # tp=2 without sequence parallelism: sbh(10 + 24/t + 5as/(ht)) = 27·sbh per layer
    tp = predict(SMALL, BIG, Choice(dp=1, pp=1, tp=2, micro_batches=1), **PLAIN)
    sbh8 = 32 * 8 * 64
    assert tp.memory["activations"] == 4 * sbh8 * (10 + 12 + 5) + 4 * 8 * 32 * 128 / 2
    # with sequence parallelism everything is split: sbh(34/t + 5as/(ht)) = 22·sbh
    sp = predict(SMALL, BIG, Choice(1, 1, 2), **{**PLAIN, "sequence_parallel": True})
    assert sp.memory["activations"] == 4 * sbh8 * (17 + 5) + 4 * 8 * 32 * 128 / 2


def test_interleaving_holds_more_activations_and_shrinks_the_bubble():
    m = Transformer(layers=8, hidden=64, heads=4, seq_len=32, vocab=128, global_batch=16,
                    vocab_multiple=1)  # fmt: skip
    one = predict(m, BIG, Choice(1, 4, 1, 0, 8, 1), **PLAIN)
    two = predict(m, BIG, Choice(1, 4, 1, 0, 8, 2), **PLAIN)
    # the first stage holds p + (p-1)/v micro-batches' worth at the peak (the simulator's 5.5
    # for p=4, v=2) instead of min(p, m) = 4
    assert two.detail["activations_first"] / one.detail["activations_first"] == pytest.approx(
        5.5 / 4
    )
    # the bubble is (p-1)/(v·m) of the compute
    assert one.time["bubble"] == pytest.approx(one.time["compute"] * 3 / 8)
    assert two.time["bubble"] == pytest.approx(two.time["compute"] * 3 / 16)
    assert "interleaving v=2 needs pp > 1 and m=6 a multiple of pp=4" in problems(
        m, Choice(1, 4, 1, 0, 6, 2)
    )


def test_the_playbook_memory_formulas():
    """The Ultra-Scale Playbook (Hugging Face, 2025): mixed precision with Adam keeps 16 bytes per
    parameter (bf16 parameters and gradients, fp32 master weights, momentum and variance), 20 with
    an fp32 gradient accumulation buffer; Megatron-LM's fp32 gradients make 18. Activations
    without recomputation: L·s·b·h·(34 + 5as/h); with full recomputation 2·s·b·h per layer."""
    m = Transformer(layers=8, hidden=256, heads=8, seq_len=128, vocab=1024, global_batch=4,
                    vocab_multiple=1)  # fmt: skip
    psi = m.params
    c = Choice(1, 1, 1, 0, 1)
    for grad_bytes, per_param in ((2, 16), (6, 20), (4, 18)):
        got = predict(m, BIG, c, grad_bytes=grad_bytes, **PLAIN).memory["model_states"]
        assert got == per_param * psi
    sbh, a, s, h = 128 * 4 * 256, 8, 128, 256
    assert layer_activation_bytes(m, b=4, attention="materialized") == sbh * (34 + 5 * a * s / h)
    full = predict(m, BIG, c, recompute="full", **PLAIN).memory["activations"]
    assert full == 8 * 2 * sbh + sbh * (34 + 5 * a * s / h) + 4 * 4 * 128 * 1024


def test_the_zero_paper_table_1():
    """Rajbhandari et al. 2020, Table 1 / Figure 1: 7.5 B parameters on 64 GPUs, K = 12:
    120 GB, 31.4 GB, 16.6 GB, 1.9 GB of model states per GPU for DP and stages 1, 2, 3."""
    from course_utils.zero import model_state_bytes

    psi = 7.5e9
    got = [model_state_bytes(psi, 64, z) / 1e9 for z in range(4)]
    assert [round(x, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]
    # the planner uses the same formulas on a shard: a data-parallel layout of one 7.5 B model
    m = narayanan_model(NARAYANAN_TABLE1[2])
    for z in range(3):
        states = predict(m, A100_80GB, Choice(64, 1, 1, z, 8)).memory["model_states"]
        assert states == pytest.approx(model_state_bytes(shard_params(m, 1, 1), 64, z))


def test_compute_efficiency_falls_for_small_micro_batches():
    cl = A100_80GB
    assert cl.matmul_efficiency(256) == pytest.approx(cl.efficiency / 2)  # the half point
    model = narayanan_model(NARAYANAN_TABLE1[0])  # B = 512, s = 2048
    small = predict(model, cl, Choice(32, 1, 1, 0, 16), overlap=False)  # b = 1
    large = predict(model, cl, Choice(32, 1, 1, 0, 2), overlap=False)  # b = 8
    assert small.detail["efficiency"] < large.detail["efficiency"] < cl.efficiency
    matmul = flops_per_step(model) / (32 * cl.peak_flops)
    assert small.time["compute"] - small.detail["elementwise"] == pytest.approx(
        matmul / small.detail["efficiency"]
    )


def test_the_h100_computes_faster_and_its_network_is_faster_too():
    """Same layout, two clusters: compute scales with the peak, the DP all-reduce with the link."""
    model = narayanan_model(NARAYANAN_TABLE1[0])
    choice = Choice(32, 1, 1, 0, 2)  # pure DP over 4 nodes
    a100 = predict(model, A100_80GB, choice, overlap=False)
    h100 = predict(model, H100_80GB, choice, overlap=False)
    matmul = {n: r.time["compute"] - r.detail["elementwise"] for n, r in (("a", a100), ("h", h100))}
    assert matmul["a"] / matmul["h"] == pytest.approx(989 / 312)
    assert a100.time["dp_comm"] > h100.time["dp_comm"]
    assert a100.memory == h100.memory  # the same bytes on two 80 GB GPUs


def test_compute_bubble_and_communication_by_hand():
    """With overlap off every term is added, as the 2021 paper's planner-free reasoning does."""
    row = NARAYANAN_TABLE1[0]  # 1.7B: L=24, h=2304, s=2048, V=51200, B=512
    model = narayanan_model(row)
    B, s, L, h, V = 512, 2048, 24, 2304, 51200
    cl = Cluster(8, 80e9, 312e12, A100_80GB.intra, A100_80GB.inter, 0.5)  # constant efficiency
    pred = predict(model, cl, Choice(dp=8, pp=4, tp=1, micro_batches=16), **PLAIN)
    # Narayanan et al. 2021, eq. 3 without recomputation (72, V/12Lh) on 32 GPUs at 50%
    compute = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)) / (32 * 156e12)
    assert pred.time["compute"] == pytest.approx(compute, rel=1e-12)
    assert pred.time["bubble"] == pytest.approx(compute * 3 / 16, rel=1e-12)  # (p-1)/m
    rec = predict(model, cl, Choice(8, 4, 1, micro_batches=16), recompute="full", **PLAIN)
    compute_rec = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)) / (32 * 156e12)
    assert rec.time["compute"] == pytest.approx(compute_rec, rel=1e-12)
    # pp: ranks pp_idx·8 + dp_idx lie on different nodes: 2(m + p - 2) messages of b·s·h·2 bytes
    b = 512 // (8 * 16)
    pp_msg = 10e-6 + b * s * h * 2 / 25e9
    assert pred.time["pp_comm"] == pytest.approx(2 * (16 + 4 - 2) * pp_msg, rel=1e-12)
    assert pred.time["tp_comm"] == 0.0
    # dp: one node per stage: a ring all-reduce of the first stage's gradients (6 layers,
    # embedding, positions; the head is tied) on NVLink
    psi = 6 * (12 * h * h + 13 * h) + V * h + s * h
    ring = 2 * 7 * 5e-6 + 2 * 7 / 8 * psi * 2 / 300e9
    assert pred.time["dp_comm"] == pytest.approx(ring, rel=1e-12)
    total = sum(pred.time[k] for k in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm"))
    assert pred.time["total"] == pytest.approx(total)


def test_tp_comm_by_hand():
    model = narayanan_model(NARAYANAN_TABLE1[3])  # L=40, h=6144, B=1024
    pred = predict(model, A100_80GB, Choice(dp=32, pp=1, tp=8, micro_batches=8), **PLAIN)
    b, s, h = 1024 // (32 * 8), 2048, 6144
    # four all-reduces of b·s·h 2-byte values per layer and micro-batch, on NVLink, t=8
    ring = 2 * 7 * 5e-6 + 2 * 7 / 8 * b * s * h * 2 / 300e9
    assert pred.time["tp_comm"] == pytest.approx(4 * 40 * 8 * ring, rel=1e-12)
    rec = predict(model, A100_80GB, Choice(32, 1, 8, micro_batches=8), recompute="full", **PLAIN)
    assert rec.time["tp_comm"] == pytest.approx(6 * 40 * 8 * ring, rel=1e-12)
    over = predict(model, A100_80GB, Choice(32, 1, 8, micro_batches=8), tp_overlap=True)
    assert over.time["tp_comm"] < 0.1 * pred.time["tp_comm"]  # hidden behind the products


def test_dp_comm_per_zero_stage_without_overlap():
    model = narayanan_model(NARAYANAN_TABLE1[2])
    t = {
        z: predict(model, A100_80GB, Choice(16, 1, 8, z), **PLAIN).time["dp_comm"] for z in range(4)
    }
    assert t[1] == pytest.approx(t[0]) and t[2] == pytest.approx(t[0])
    assert t[3] == pytest.approx(1.5 * t[0])  # ZeRO paper: 3Ψ against 2Ψ
    # with m = 4 micro-batches a sharded gradient is reduce-scattered after each of them, and
    # ZeRO-3 gathers the parameters for each forward and backward
    t4 = {z: predict(model, A100_80GB, Choice(16, 1, 8, z, 4), **PLAIN).time["dp_comm"]
          for z in range(4)}  # fmt: skip
    assert t4[0] == pytest.approx(t[0]) and t4[1] == pytest.approx(t[0])
    assert t4[2] == pytest.approx(t[0] / 2 * 4 + t[0] / 2)
    assert t4[3] == pytest.approx(4 * 1.5 * t[0])


def test_dp_comm_hides_behind_backward_except_the_last_bucket():
    model = narayanan_model(NARAYANAN_TABLE1[0])  # 1.7 B, pure DP across 4 nodes
    c = Choice(32, 1, 1, 0, 1)
    plain = predict(model, A100_80GB, c, overlap=False)
    over = predict(model, A100_80GB, c)
    total = plain.time["dp_comm"]
    last = A100_80GB.inter.all_reduce(25 * 2**20, 32)  # one 25 MiB bucket, after backward
    assert over.time["dp_comm"] == pytest.approx(last)  # the rest ran during backward
    assert over.detail["hidden"]["dp_comm"] == pytest.approx(total - last)
    # hidden communication is not free: a fifth of it slows the compute it overlaps
    assert over.time["compute"] - plain.time["compute"] == pytest.approx(0.2 * (total - last))
    text = explain(over, model, A100_80GB)
    assert "hidden behind compute" in text and "exposed" in text


def test_zero3_with_a_pipeline_is_costed_as_torch_pipelining_runs_it():
    """Inside a pipeline, FSDP keeps each stage's parameters gathered and defers the gradients'
    reduce-scatter to the last micro-batch: one all-gather and one reduce-scatter per step, and
    the stage's parameters and gradients whole in memory meanwhile."""
    model = narayanan_model(NARAYANAN_TABLE1[4])  # 39 B
    c3, c1 = Choice(8, 4, 8, 3, 16), Choice(8, 4, 8, 1, 16)
    p3, p1 = predict(model, A100_80GB, c3, **PLAIN), predict(model, A100_80GB, c1, **PLAIN)
    assert p3.time["dp_comm"] == pytest.approx(p1.time["dp_comm"])  # Ψ gathered + Ψ reduced
    psi = p3.detail["params_per_gpu"]
    assert p3.memory["model_states"] == pytest.approx(psi * (2 / 8 + 2 / 8 + 12 / 8) + psi * 4)


def test_fits_against_headroom():
    need = predict(SMALL, BIG, Choice(2, 1, 1)).memory["total"]
    tight = Cluster(8, need / 0.9 * 0.99, 1e12, AlphaBeta(0, 1e9), AlphaBeta(0, 1e9))
    pred = predict(SMALL, tight, Choice(2, 1, 1))
    assert not pred.fits
    assert "needs 0.0 GB per GPU" in pred.reasons[0] and "90% of" in pred.reasons[0]
    assert predict(SMALL, tight, Choice(2, 1, 1), memory_headroom=0.95).fits


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
    assert "layers=4 < pp=8 × v=1: a stage chunk would have no layer" in problems(
        SMALL, Choice(1, 8, 1)
    )
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
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=8"):
        Transformer(2, 64, 8, 16, 64, 4, kv_heads=3)
    with pytest.raises(ValueError, match="recompute must be one of"):
        predict(SMALL, BIG, Choice(1, 1, 1), recompute="some")


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
    # v = 2 where pp > 1, 2·pp ≤ 4 layers and m a multiple of pp: (4, 2, 1) m=2, (2, 2, 2) m=2, 4,
    # (1, 2, 4) m=2, 4, 8
    inter = [c for c in valid_choices(SMALL, 8, zero_stages=(0,), interleave=(2,))]
    assert {(c.dp, c.pp, c.tp, c.micro_batches) for c in inter if c.interleave == 2} == {
        (4, 2, 1, 2), (2, 2, 2, 2), (2, 2, 2, 4), (1, 2, 4, 2), (1, 2, 4, 4), (1, 2, 4, 8)
    }  # fmt: skip


def test_plan_ranks_fitting_first_then_by_time_and_simplest_within_tolerance():
    model = narayanan_model(NARAYANAN_TABLE1[2])  # 7.5B on 16 GPUs: some layouts fit, some not
    preds = plan(model, A100_80GB, 16, tolerance=0.0)
    fits = [p.fits for p in preds]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)
    times = [p.time["total"] for p in preds if p.fits]
    assert times == sorted(times)
    assert all(p.choice.n_gpus == 16 for p in preds)
    with pytest.raises(ValueError, match="no layout of 7 GPUs"):
        plan(Transformer(2, 64, 4, 32, 128, 8), A100_80GB, 7)
    # with a tolerance, the simplest layout within 3% of the fastest comes first
    ranked = plan(model, A100_80GB, 16)
    best = ranked[0]
    assert best.time["total"] <= 1.03 * times[0]
    near = [p for p in preds if p.fits and p.time["total"] <= 1.03 * times[0]]
    assert min(p.choice.pp for p in near) == best.choice.pp


def test_tp_across_nodes_is_never_the_top_pick_where_a_layout_without_it_fits():
    preds = plan(GPT3_175B, A100_80GB, 1024, tolerance=0.0)
    assert preds[0].fits and preds[0].links["tp"] == "intra"
    first_inter = next(
        i for i, p in enumerate(preds) if p.links["tp"] == "inter" and p.choice.tp > 1
    )
    assert all(p.fits is False or p.links["tp"] == "intra" for p in preds[:first_inter])
    # the rule itself: a faster layout whose TP crosses nodes still ranks after one that fits
    # with TP inside a node
    from course_utils.plan.layouts import _rank

    across = predict(GPT3_175B, A100_80GB, Choice(8, 8, 16, 1, 96))
    inside = predict(GPT3_175B, A100_80GB, Choice(16, 8, 8, 1, 96))
    assert across.links["tp"] == "inter" and inside.links["tp"] == "intra"
    across.time["total"], across.fits, inside.fits = inside.time["total"] / 2, True, True
    assert sorted([across, inside], key=_rank)[0] is inside


def test_explain_and_table():
    model = narayanan_model(NARAYANAN_TABLE1[2])
    text = explain(predict(model, A100_80GB, Choice(2, 4, 2, 1, 64)), model, A100_80GB)
    assert "TP=2 stays inside a node on NVLink with sequence parallelism" in text
    assert "PP=4 across nodes" in text and "DP=2 over the rest, inside a node" in text
    wide = explain(predict(model, A100_80GB, Choice(1, 1, 16, 0, 512)), model, A100_80GB)
    assert "TP=16 crosses nodes (tp=16 > 8 GPUs per node)" in wide
    md = table(plan(SMALL, BIG, 8), limit=3).splitlines()
    assert md[0].startswith("| dp | pp | tp | zero | m | b | v | recompute | memory GB | step s")
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


# ---- against published runs ---------------------------------------------------------------------


@pytest.mark.parametrize("row", NARAYANAN_TABLE1, ids=lambda r: f"{r['params_b']}B")
def test_narayanan_table1_layouts_predicted_within_20_percent(row):
    """Narayanan et al. 2021 (arXiv:2104.04473), Table 1: each model run with the paper's own
    (t, p), full recomputation and materialised attention, on Selene's A100s. The step time the
    paper measured follows from its teraFLOP/s per GPU and eq. 3; the planner, whose compute
    efficiency is compute only (not fitted to this table), predicts it within 20%."""
    pred = paper_layout(row)
    assert pred.fits
    assert 0.8 < pred.time["total"] / measured_step_s(row) < 1.2


def test_compare_narayanan_picks():
    rows = compare_narayanan()
    assert len(rows) == len(NARAYANAN_TABLE1) == 10
    for row in rows:
        assert row["t"] <= A100_80GB.gpus_per_node and row["fits"]
        assert row["t"] * row["p"] * row["dp"] == row["gpus"]
    for row in rows[6:]:  # 145 B and up: TP fills the node and PP spans nodes, as the paper did
        assert row["t"] == 8 and row["p"] > 1


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda r: r.name)
def test_top_pick_matches_what_public_runs_used(run):
    """The planner's first layout for public configurations, beside what those runs used (the
    source of each is in course_utils.plan.published.PUBLISHED_RUNS):

    - GPT-3 175B on 1,024 A100s (Narayanan et al. 2021): tensor parallelism of 8 inside each node,
      a pipeline across nodes, data parallelism over the rest;
    - Llama-3-style 8B on one node of 8 H100s (torchtitan's llama3_8b.toml): pure data
      parallelism, its states sharded (FSDP), no tensor or pipeline parallelism;
    - Llama-3-style 70B on 64 H100s (torchtitan's llama3_70b.toml): tensor parallelism of 8 inside
      each node, sharded data parallelism over the 8 nodes, no pipeline; its TP communication
      overlapped with compute, as H100 runs do it today (torchtitan's async TP, Megatron-Core's
      --tp-comm-overlap)."""
    kw = {"tp_overlap": True} if run.model is LLAMA3_70B else {}
    best = plan(run.model, run.cluster, run.gpus, **kw)[0]
    c = best.choice
    assert best.fits and best.links["tp"] == "intra"
    assert c.tp == run.tp
    if run.pp > 1:
        assert c.pp > 1  # a pipeline across nodes (the planner may choose fewer stages)
    else:
        assert (c.pp, c.dp) == (run.pp, run.dp) and c.zero >= 1


def test_practitioners_picks_for_small_models():
    """What the old planner got wrong (issue 26): models that fit with ZeRO train with data
    parallelism, without a pipeline. 1.7 B on 32 A100s and an 8 B GPT on one 8-GPU node."""
    small = plan(narayanan_model(NARAYANAN_TABLE1[0]), A100_80GB, 32)[0].choice
    assert (small.pp, small.tp) == (1, 1)
    gpt8 = Transformer(32, 4096, 32, 2048, 51200, 512, name="8B")
    eight = plan(gpt8, A100_80GB, 8)[0].choice
    assert (eight.pp, eight.tp, eight.dp) == (1, 1, 8) and eight.zero >= 1
    assert math.isclose(plan(gpt8, A100_80GB, 8)[0].memory["limit"], 72e9)


def test_fewer_micro_batches_than_stages_hold_only_those_in_flight():
    # p=4, m=2: b = 8/2 = 4 sequences, one layer per stage; the first stage holds min(p, m) = 2
    # micro-batches at its peak, not p = 4: there are only two to hold
    pred = predict(SMALL, BIG, Choice(dp=1, pp=4, tp=1, micro_batches=2), **PLAIN)
    sbh = 32 * 4 * 64
    assert pred.detail["activations_first"] == 1 * 2 * sbh * 44  # sbh(34 + 5as/h), as/h = 2


def test_explain_states_the_interleaved_bubble_with_v():
    m = Transformer(layers=8, hidden=64, heads=4, seq_len=32, vocab=128, global_batch=16,
                    vocab_multiple=1)  # fmt: skip
    c = Choice(1, 4, 1, 0, 8, 2)  # p=4, m=8, v=2: (p-1)/(v·m+p-1) = 3/19
    text = explain(predict(m, BIG, c, **PLAIN), m, BIG)
    assert f"= {3 / 19:.1%} of the step" in text and "15.8%" in text
    assert f"{3 / 11:.1%}" not in text  # what the bubble would be without interleaving
