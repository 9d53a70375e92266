"""Tensor parallelism: every layer, apply_tp and the transformer against one process (float64),
the collectives counted against Megatron-LM, activation memory against Korthikanti et al., and
the plans apply_tp refuses before changing anything."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_utils import launch
from course_utils.comm import CollectiveCounter, ring_bytes
from course_utils.measure import saved_activations
from course_utils.models import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from course_utils.tensor_parallel import (
    ColumnParallelLinear,
    PlanError,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tp,
    gpt_plan,
)
from course_utils.tensor_parallel.measure import (
    activation_bytes_per_layer,
    dropout_mask_bytes,
    megatron_bytes_per_layer,
)
from course_utils.tensor_parallel.parity import gpt_parity, hidden_batch, parity_worker

# make test-floor runs these on the oldest torch too: DTensor and parallelize_module
pytestmark = [pytest.mark.floor]

CFG = GPTConfig(vocab=64, seq_len=8, d_model=32, n_heads=4, n_layers=2)
TOL = 1e-12  # float64


# --- cases: (name, make_model, plan, loss); every one runs on 2 and on 4 ranks -----------------


def _tokens_to_hidden():
    return nn.Sequential(nn.Embedding(CFG.vocab, CFG.d_model))


def _token_batch(gen, dtype, device):
    x = torch.randint(CFG.vocab, (3, CFG.seq_len), generator=gen)
    return x.to(device), torch.randn(3, CFG.seq_len, CFG.d_model, generator=gen, dtype=dtype).to(
        device
    )


def _seq(module):
    return nn.Sequential(module)  # so that a plan can name the module's input ("0")


CASES = {
    "column_gather": (lambda: nn.Sequential(nn.Linear(32, 32)), {"0": "colwise_gather"}),
    "column_row": (
        lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
        {"0": "colwise", "2": "rowwise"},
    ),
    "row_without_bias": (
        lambda: nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)),
        {"0": "colwise", "1": "rowwise"},
    ),
    "mlp": (lambda: MLP(CFG), {"up": "colwise", "down": "rowwise"}),
    "attention": (lambda: CausalSelfAttention(CFG), {"qkv": "colwise", "proj": "rowwise"}),
    "block": (
        lambda: Block(CFG),
        {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.up": "colwise", "mlp.down": "rowwise"},
    ),
    "block_sp": (
        lambda: _seq(Block(CFG)),
        {
            "0": "sequence_input",
            "0.ln1": "sequence",
            "0.attn.qkv": "colwise_sp",
            "0.attn.proj": "rowwise_sp",
            "0.ln2": "sequence",
            "0.mlp.up": "colwise_sp",
            "0.mlp.down": "rowwise_sp",
        },
    ),
}


def layer_cases_worker(ctx, names):
    out = {}
    for name in names:
        make, plan = CASES[name]
        out[name] = parity_worker(
            ctx, make, hidden_batch(CFG, 3), lambda m, plan=plan: apply_tp(m, plan), steps=3
        )
    out["vocab_embedding"] = parity_worker(
        ctx, _tokens_to_hidden, _token_batch, lambda m: apply_tp(m, {"0": "vocab"}), steps=3
    )
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_layer_equals_one_process(runs_root, world_size):
    res = launch(layer_cases_worker, world_size, names=list(CASES), echo=False, timeout=240)
    for rank, cases in enumerate(res.results):
        for name, d in cases.items():
            for what in ("out", "loss", "input_grad", "grads", "params"):
                assert d[what] < TOL, (name, rank, what, d[what])
            assert len(set(d["losses"])) == len(d["losses"]), (name, "the loss must move")


def _gpt_worker(ctx, runs):
    return {f"{impl}-sp{int(sp)}": gpt_parity(ctx, CFG, sp, impl) for impl, sp in runs}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_from_scratch_and_torch_equal_one_process(runs_root, world_size):
    runs = [("scratch", False), ("scratch", True), ("torch", False), ("torch", True)]
    res = launch(_gpt_worker, world_size, runs=runs, echo=False, timeout=240)
    for rank, per in enumerate(res.results):
        for key, d in per.items():
            for what in ("out", "loss", "grads", "params"):
                assert d[what] < TOL, (key, rank, what, d[what])
    # the plan applied everywhere: every sharded parameter has 1/t of the full rows or columns
    shapes = res.results[1]["scratch-sp0"]["shapes"]
    t, h, v = world_size, CFG.d_model, CFG.vocab
    assert shapes["embed.weight"] == ("Parameter", (v // t, h))
    assert shapes["pos.weight"] == ("Parameter", (CFG.seq_len, h))
    assert shapes["head.weight"] == ("Parameter", (v // t, h))
    for i in range(CFG.n_layers):
        b = f"blocks.{i}"
        assert shapes[f"{b}.attn.qkv.weight"] == ("Parameter", (3 * h // t, h))
        assert shapes[f"{b}.attn.qkv.bias"] == ("Parameter", (3 * h // t,))
        assert shapes[f"{b}.attn.proj.weight"] == ("Parameter", (h, h // t))
        assert shapes[f"{b}.attn.proj.bias"] == ("Parameter", (h,))
        assert shapes[f"{b}.mlp.up.weight"] == ("Parameter", (4 * h // t, h))
        assert shapes[f"{b}.mlp.down.weight"] == ("Parameter", (h, 4 * h // t))
        assert shapes[f"{b}.ln1.weight"] == ("Parameter", (h,))
    torch_shapes = res.results[1]["torch-sp0"]["shapes"]
    assert {k: s for k, (_, s) in torch_shapes.items()} == {k: s for k, (_, s) in shapes.items()}
    assert torch_shapes["head.weight"][0] == "DTensor"


def _types_worker(ctx):
    model = apply_tp(GPT(CFG), gpt_plan())
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    return kinds


@pytest.mark.multiprocess
def test_apply_tp_swaps_every_planned_module(runs_root):
    kinds = launch(_types_worker, 2, echo=False).results[0]
    assert kinds["embed"] == VocabParallelEmbedding.__name__
    assert kinds["head"] == ColumnParallelLinear.__name__
    for i in range(CFG.n_layers):
        assert kinds[f"blocks.{i}.attn.qkv"] == ColumnParallelLinear.__name__
        assert kinds[f"blocks.{i}.attn.proj"] == RowParallelLinear.__name__
        assert kinds[f"blocks.{i}.mlp.up"] == ColumnParallelLinear.__name__
        assert kinds[f"blocks.{i}.mlp.down"] == RowParallelLinear.__name__
    assert "Linear" not in kinds.values() and "Embedding" in kinds.values()  # pos stays whole


def _dropout_worker(ctx):
    from course_utils.tensor_parallel.random import ForkedDropout, RNGTracker

    torch.manual_seed(0)  # the same default seed on every rank
    cfg = GPTConfig(vocab=64, seq_len=8, d_model=32, n_heads=4, n_layers=1, dropout=0.5)
    model = apply_tp(GPT(cfg), gpt_plan(), seed=3)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    drop = model.blocks[0].attn.attn_drop
    x = torch.ones(2, 2, 8, 8)
    torch.manual_seed(1)
    forked = drop(x) > 0  # this rank's heads: its own stream
    default = torch.nn.functional.dropout(x, 0.5) > 0  # afterwards, the default stream, unchanged
    before = torch.get_rng_state()
    with RNGTracker(seed=3).fork():
        torch.rand(3)
    restored = torch.equal(before, torch.get_rng_state())
    return {"kind": kinds["blocks.0.attn.attn_drop"], "p": drop.p, "forked": forked,
            "default": default, "restored": restored, "is_forked": isinstance(drop, ForkedDropout)}  # fmt: skip


@pytest.mark.multiprocess
def test_dropout_in_the_tp_region_differs_across_ranks_and_nowhere_else(runs_root):
    r0, r1 = launch(_dropout_worker, 2, echo=False).results
    assert r0["is_forked"] and r0["kind"] == "ForkedDropout" and r0["p"] == 0.5
    assert not torch.equal(r0["forked"], r1["forked"])  # each rank's heads: their own masks
    assert torch.equal(r0["default"], r1["default"])  # the default stream: the same everywhere
    assert r0["restored"] and r1["restored"]  # fork() leaves the default stream where it was


# --- refusals: before anything changes -------------------------------------------------------


def _refusal_worker(ctx):
    found = {}
    cases = {
        "missing": {"blocks.7.mlp.up": "colwise"},
        "style": {"blocks.0.mlp.up": "columnwise"},
        "heads": {"blocks.*.attn.qkv": "colwise"},  # 4 heads over 3 ranks
        "vocab": {"blocks.0.mlp.up": "colwise", "embed": "vocab"},  # 64 rows over 3 ranks
        "type": {"blocks.0.ln1": "colwise"},
        "twice": {"blocks.*.mlp.up": "colwise", "blocks.0.mlp.up": "rowwise"},
        "dropout": {"blocks.0.ln1": "dropout_tp"},
    }
    for key, plan in cases.items():
        model = GPT(GPTConfig(vocab=64, seq_len=6, d_model=36, n_heads=4, n_layers=2))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        types = [type(m) for m in model.modules()]
        try:
            apply_tp(model, plan)
            found[key] = None
        except PlanError as e:
            found[key] = str(e)
        after = model.state_dict()
        unchanged = types == [type(m) for m in model.modules()] and all(
            torch.equal(before[k], after[k]) for k in before
        )
        found[key + "_unchanged"] = unchanged
    return found


@pytest.mark.multiprocess
def test_bad_plans_are_refused_before_any_change(runs_root):
    found = launch(_refusal_worker, 3, echo=False).results[0]
    assert "has no such module" in found["missing"] and "blocks.7.mlp.up" in found["missing"]
    assert "unknown style" in found["style"]
    assert "4 heads" in found["heads"] and "t=3" in found["heads"]
    assert "num_embeddings=64" in found["vocab"] and "t=3" in found["vocab"]
    assert "needs an nn.Linear" in found["type"]
    assert "named twice" in found["twice"]
    assert "'dropout_tp' needs an nn.Dropout" in found["dropout"]
    assert all(found[k + "_unchanged"] for k in ("missing", "style", "heads", "vocab", "type"))


def test_apply_tp_without_a_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="course_utils.launch"):
        apply_tp(GPT(CFG), gpt_plan())


# --- communication counted against Megatron-LM ----------------------------------------------


def _wrapped_layer_plan(sequence_parallel):
    """Megatron's plan for a Block wrapped in nn.Sequential (so that "0" names its input)."""
    plan = {
        "0.attn.qkv": "colwise",
        "0.attn.proj": "rowwise",
        "0.mlp.up": "colwise",
        "0.mlp.down": "rowwise",
    }
    if sequence_parallel:
        plan = {k: v + "_sp" for k, v in plan.items()} | {
            "0": "sequence_input",
            "0.ln1": "sequence",
            "0.ln2": "sequence",
        }
    return plan


def _count_worker(ctx, sequence_parallel):
    torch.manual_seed(0)
    b, dtype = 3, torch.float64
    out = {}
    block = nn.Sequential(Block(CFG)).to(ctx.device, dtype)
    apply_tp(block, _wrapped_layer_plan(sequence_parallel))
    for needs_grad in (True, False):
        x = torch.randn(b, CFG.seq_len, CFG.d_model, dtype=dtype, device=ctx.device)
        x.requires_grad_(needs_grad)
        with CollectiveCounter() as fwd:
            y = block(x)
        with CollectiveCounter() as bwd:
            y.square().sum().backward()
        out[needs_grad] = {"fwd": fwd.calls, "bwd": bwd.calls}
    mlp = apply_tp(MLP(CFG).to(ctx.device, dtype), {"up": "colwise", "down": "rowwise"})
    x = torch.randn(b, CFG.seq_len, CFG.d_model, dtype=dtype, device=ctx.device)  # data
    with CollectiveCounter() as fwd:
        y = mlp(x)
    with CollectiveCounter() as bwd:
        y.square().sum().backward()
    out["mlp_on_data"] = {"fwd": fwd.calls, "bwd": bwd.calls}
    return out


def _kinds(calls):
    kinds = {}
    for kind, _ in calls:
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_two_all_reduces_forward_and_two_backward_per_layer(runs_root, world_size):
    res = launch(_count_worker, world_size, sequence_parallel=False, echo=False).results[0]
    t, bsh_bytes = world_size, 3 * CFG.seq_len * CFG.d_model * 8
    for needs_grad in (True, False):  # LayerNorm's weights need the input gradient either way
        calls = res[needs_grad]
        assert calls["fwd"] == [("all_reduce", bsh_bytes)] * 2
        assert calls["bwd"] == [("all_reduce", bsh_bytes)] * 2
        sent = sum(ring_bytes(k, n, t) for k, n in calls["fwd"] + calls["bwd"])
        assert sent == pytest.approx(megatron_bytes_per_layer(3, CFG.seq_len, CFG.d_model, t, 8))
    # an MLP on raw data: f's backward all-reduce would only compute the data's gradient
    assert res["mlp_on_data"] == {"fwd": [("all_reduce", bsh_bytes)], "bwd": []}


@pytest.mark.multiprocess
def test_sequence_parallel_swaps_all_reduce_for_gather_and_scatter_same_bytes(runs_root):
    t = 2
    plain = launch(_count_worker, t, sequence_parallel=False, echo=False).results[0][True]
    sp = launch(_count_worker, t, sequence_parallel=True, echo=False).results[0][True]
    assert _kinds(sp["fwd"]) == {"all_gather": 2, "reduce_scatter": 2}
    sent = {
        name: sum(ring_bytes(k, n, t) for k, n in calls["fwd"])
        for name, calls in (("plain", plain), ("sp", sp))
    }
    assert sent["sp"] == sent["plain"]
    # backward: 2 reduce-scatters of the column layers' input gradients; all-gathers of the row
    # layers' output gradients (2), of the column layers' inputs once more (2) and of the layer's
    # input gradient where the sequence was split (1); the small all-reduces of the LayerNorms'
    # and row biases' gradients (6 parameters)
    assert _kinds(sp["bwd"]) == {"all_gather": 5, "reduce_scatter": 2, "all_reduce": 6}


# --- activation memory against Korthikanti et al. 2022, Table 2 ------------------------------

MEM_CFG = GPTConfig(vocab=64, seq_len=32, d_model=64, n_heads=4, n_layers=1, dropout=0.1)


def _saved_bytes(block, x):
    with saved_activations() as mem:
        block(x)
    return mem["bytes"]


def test_table2_coefficients():
    s, b, h, a = 2048, 1, 1024, 16
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, t=8) == pytest.approx(
        sbh * (10 + 24 / 8 + 5 * a * s / (h * 8))
    )
    assert activation_bytes_per_layer(s, b, h, a, t=8, sequence_parallel=True) == pytest.approx(
        sbh * (34 / 8 + 5 * a * s / (h * 8))
    )
    assert activation_bytes_per_layer(s, b, h, a, act_bytes=4) == sbh * (66 + 9 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, act_bytes=4, mask_bytes=4) == sbh * (
        72 + 12 * a * s / h
    )
    assert dropout_mask_bytes("cpu", torch.float32) == 4 and dropout_mask_bytes("cuda") == 1


def test_one_layer_saves_what_table2_says_in_float32():
    torch.manual_seed(0)
    c = MEM_CFG
    b = 2
    measured = _saved_bytes(Block(c), torch.randn(b, c.seq_len, c.d_model))
    want = activation_bytes_per_layer(c.seq_len, b, c.d_model, c.n_heads, act_bytes=4, mask_bytes=4)
    extra = 2 * 2 * c.seq_len * b * 4  # each LayerNorm also keeps its mean and 1/std per token
    assert measured == want + extra


def _memory_worker(ctx, sequence_parallel):
    c, b = MEM_CFG, 2
    torch.manual_seed(0)
    block = nn.Sequential(Block(c)).to(ctx.device)
    apply_tp(block, _wrapped_layer_plan(sequence_parallel))
    return _saved_bytes(block, torch.randn(b, c.seq_len, c.d_model, device=ctx.device))


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_layer_saves_what_table2_says(runs_root, sequence_parallel):
    c, b, t = MEM_CFG, 2, 2
    res = launch(_memory_worker, t, sequence_parallel=sequence_parallel, echo=False).results
    want = activation_bytes_per_layer(
        c.seq_len,
        b,
        c.d_model,
        c.n_heads,
        t=t,
        sequence_parallel=sequence_parallel,
        act_bytes=4,
        mask_bytes=4,  # on the CPU dropout keeps a float32 mask (a GPU keeps a 1-byte one)
    )
    stats = 2 * 2 * c.seq_len * b * 4 // (t if sequence_parallel else 1)  # LayerNorm mean, 1/std
    assert res == [want + stats] * t
