"""ZeRO stages 1-3 from scratch (course_utils.zero): the paper's formulas, equality with one
process, the bytes each rank holds and sends, and torch's ZeroRedundancyOptimizer interface."""

from __future__ import annotations

import itertools

import pytest
import torch

from course_utils import launch
from course_utils.compat import fsdp2_unsupported
from course_utils.measure import worst
from course_utils.zero import model_state_bytes
from course_utils.zero.parity import parity_many

# make test-floor runs these on the oldest torch too: FSDP2, ZeroRedundancyOptimizer, reduce_scatter_tensor
pytestmark = [pytest.mark.floor]

GB = 1e9  # the paper's GB

# Rajbhandari et al. 2020, Table 1: per-device GB for P_os, P_os+g, P_os+g+p (K = 12).
TABLE1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000),
           64: (4187, 2218, 250), 256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}  # fmt: skip


def _digits(printed: float) -> float:
    """One unit in the last printed digit of a number of Table 1."""
    text = repr(printed)
    return 10 ** -(len(text.split(".")[1])) if "." in text and not text.endswith(".0") else 1.0


@pytest.mark.parametrize("psi", sorted(TABLE1))
def test_formula_reproduces_every_row_of_table1(psi):
    for n, printed in TABLE1[psi].items():
        for stage, want in zip((1, 2, 3), printed):
            got = model_state_bytes(psi, n, stage) / GB
            # the paper rounds some entries and truncates others: within one printed unit
            assert abs(got - want) <= _digits(want), (psi, n, stage, got, want)


def test_formula_reproduces_figure1():
    psi, n = 7.5e9, 64  # Figure 1: 7.5 B parameters on 64 GPUs
    got = [model_state_bytes(psi, n, s) / GB for s in range(4)]
    assert got[0] == 120
    assert [round(g, 1) for g in got[1:]] == [31.4, 16.6, 1.9]


def test_formula_other_precisions_and_bad_input():
    assert model_state_bytes(1000, 4, 0, k=8, param_bytes=4, grad_bytes=4) == 16_000
    assert model_state_bytes(1000, 4, 3, k=8, param_bytes=4, grad_bytes=4) == 4_000
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        model_state_bytes(1000, 4, 4)
    with pytest.raises(ValueError, match="world_size"):
        model_state_bytes(1000, 0, 1)


CASES = [
    (m, o, torch.float64) for m, o in itertools.product(("mlp", "tied", "frozen"), ("adam", "sgd"))
] + [("mlp", "adam", torch.float32)]
FLOAT32_TOL = 1e-5  # Adam lr 1e-2, 3 steps: float32's rounding of gradients, not an algorithm


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", ["zero1", "zero2", "zero3"])
def test_every_stage_equals_one_process(method, n, runs_root):
    results = launch(parity_many, n, method=method, cases=CASES, echo=False, timeout=180).results
    for r in results:  # every rank's parameters, ranks fed different data
        for (model, opt, dtype), out in zip(CASES, r):
            tol = 1e-12 if dtype == torch.float64 else FLOAT32_TOL
            assert worst(out["diffs"]) <= tol, (method, model, opt, dtype, out["diffs"])
    rank0 = results[0]
    for (model, opt, dtype), out in zip(CASES, rank0):
        if dtype != torch.float64:
            continue
        psi, s = out["psi"], out["states"]
        stage = int(method[-1])
        # model states against the formula in float64 (8-byte parameters and gradients; Adam keeps
        # two 8-byte states per parameter, SGD one): within 5%, the rest is padding. The frozen
        # fc1 stays whole on every rank and outside Ψ, so it is taken off.
        k = {"adam": 16, "sgd": 8}[opt]
        want = model_state_bytes(psi, n, stage, k=k, param_bytes=8, grad_bytes=8)
        frozen = 8 * (16 * 32 + 32) if model == "frozen" else 0  # fc1: (32, 16) + 32, float64
        got = s["parameters"] + s["gradients"] + s["optimizer"] - frozen
        assert got == pytest.approx(want, rel=0.05), (method, model, opt, s, want)
        # the bytes sent per step, the paper's way: 2Ψ for stages 1 and 2, 3Ψ for stage 3
        expected = {1: 2.0, 2: 2.0, 3: 3.0}[stage]
        if not (model == "tied" and stage == 3):  # fc2 used twice: gathered twice in forward
            assert out["volume_per_psi"] == pytest.approx(expected, rel=0.01), (model, out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("impl", ["torch", "ours"])
def test_sharded_optimizer_passes_a_test_written_for_zero_redundancy_optimizer(impl, runs_root):
    from tests.workers import zero_interface

    assert launch(zero_interface, 2, impl=impl, echo=False, timeout=120).results == ["ok"] * 2


@pytest.mark.multiprocess
def test_stage2_reduces_buckets_during_backward_and_frees_gradients(runs_root):
    from tests.workers import zero2_overlap

    for r in launch(zero2_overlap, 2, echo=False, timeout=120).results:
        assert r["buckets"] == 4  # one Linear (32·32 + 32 elements) per bucket
        # the last three layers' buckets went out while backward was still computing the first
        assert r["launched_before_first_layer"] == 3, r
        assert r["grads_left"] == []  # every full gradient was freed after its reduce-scatter


@pytest.mark.multiprocess
def test_stage3_holds_its_shards_plus_one_unit_at_a_time(runs_root):
    from tests.workers import zero3_peak

    n, b = 2, 4  # ranks; bytes per float32
    for units in ("layer", "model"):
        for r in launch(zero3_peak, n, units=units, echo=False, timeout=120).results:
            sizes = r["sizes"]
            shards = sum(-(-s // n) for s in sizes) if units == "layer" else -(-sum(sizes) // n)
            # Zhao et al. 2023, §3.2: Σψ/n + max ψᵢ, padding to a multiple of n included
            biggest = (
                max(-(-s // n) * n for s in sizes) if units == "layer" else -(-sum(sizes) // n) * n
            )
            assert r["peak"] == b * (shards + biggest), (units, r)
            assert r["after"] == 0  # every unit freed after its gradients were reduce-scattered


@pytest.mark.multiprocess
def test_torch_zero_redundancy_and_fsdp2_equal_one_process(runs_root):
    cases = [("mlp", "adam", torch.float64), ("frozen", "sgd", torch.float64)]
    methods = ("ddp", "zero-redundancy") + (() if fsdp2_unsupported("cpu") else ("fsdp2",))
    for method in methods:
        for r in launch(
            parity_many, 2, method=method, cases=cases, echo=False, timeout=180
        ).results:
            for case, out in zip(cases, r):
                assert worst(out["diffs"]) <= 1e-12, (method, case, out["diffs"])


def test_fsdp2_on_cpu_is_refused_below_torch_2_7_with_the_way_out(monkeypatch):
    import course_utils.compat as compat

    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    why = compat.fsdp2_unsupported("cpu")
    assert "torch 2.7" in why and "2.6.0" in why and "ShardedModel" in why
    assert compat.fsdp2_unsupported("cuda") is None
    monkeypatch.setattr(torch, "__version__", "2.7.1")
    assert compat.fsdp2_unsupported("cpu") is None


def test_refusals_say_what_to_do():
    from course_utils.zero import ShardedModel, ShardedOptimizer

    with pytest.raises(RuntimeError, match="inside a rank"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="inside a rank"):
        ShardedModel(torch.nn.Linear(2, 2))


def test_decide_follows_the_lectures_rules():
    """decide() weighs memory (the planner's states and Korthikanti's activations) and time."""
    from dataclasses import replace

    from course_utils.comm.model import AlphaBeta
    from course_utils.parallel3d.decide import decide, table
    from course_utils.plan import A100_80GB, GPT3_175B, Transformer, plan

    small = Transformer(24, 2048, 16, 2048, 51200, 512, name="1.3B")
    r = decide(small, A100_80GB, 8)
    assert all(row["fits"] for row in r["rows"])  # it fits on one GPU: DDP or ZeRO, by time
    # the advice is the planner's pick, whatever it is, and names the fastest data-parallel stage
    top = plan(small, A100_80GB, 8)[0].choice
    assert r["overall"].choice == top
    assert f"dp={top.dp} pp={top.pp} tp={top.tp}" in r["advice"][0]
    pick = min(r["rows"], key=lambda row: (row["step_s"], row["stage"]))
    assert pick["name"] in " ".join(r["advice"])
    mid_model = Transformer(40, 5120, 40, 2048, 51200, 512, name="13B")
    mid = decide(mid_model, A100_80GB, 8)
    assert [row["fits"] for row in mid["rows"]][:2] == [
        False,
        False,
    ]  # 236 GB of replicated states (18 bytes per parameter)
    assert mid["overall"].choice == plan(mid_model, A100_80GB, 8)[0].choice
    # nothing fits on 8 GPUs: 175 B parameters are 350 GB in 16 bits, ZeRO-Offload cannot help
    none = decide(GPT3_175B, A100_80GB, 8)
    assert not any(row["fits"] for row in none["rows"]) and not none["overall"].fits
    assert "ZeRO-Infinity" in none["advice"][0] and "cannot help" in none["advice"][0]
    # one layer too large to gather (4 layers of 20 B parameters): tensor parallelism
    wide = Transformer(4, 40960, 320, 2048, 51200, 64, name="wide")
    w = decide(wide, A100_80GB, 64)
    assert not any(row["fits"] for row in w["rows"])
    assert "tensor parallelism inside a node" in w["advice"][0] and w["overall"].choice.tp > 1
    # no fast link inside the node (PCIe): the lectures say pipeline rather than TP, but the advice
    # follows the planner's pick, and here TP over PCIe is faster than any layout without it
    pcie = replace(A100_80GB, intra=AlphaBeta(10e-6, 25e9), name="PCIe")
    p = decide(wide, pcie, 64)
    assert "PCIe only" in p["advice"][0] and "yet tensor parallelism" in p["advice"][0]
    # a pipeline keeps each 20 B-parameter layer whole on one GPU: without TP nothing fits
    assert not [q for q in plan(wide, pcie, 64) if q.fits and q.choice.tp == 1]
    assert "no layout without TP fits" in p["advice"][0] and p["overall"].choice.tp > 1
    # long sequences whose activations fit no layout without TP: the advice says so
    long = decide(Transformer(16, 16384, 128, 16384, 51200, 16, name="long"), pcie, 16)
    assert "no layout without TP fits" in long["advice"][0] and long["overall"].choice.tp > 1
    assert "fits in 72 GB?" in table(r)
    with pytest.raises(ValueError, match="does not split over 7"):
        decide(small, A100_80GB, 7)


def test_decide_counts_zero3s_gathered_layer():
    """ZeRO-3's states (FSDP as torchtitan keeps them): 16Ψ/n plus two layers gathered in bf16
    (the one computing and the one prefetched) and one layer's fp32 gradient, which can tip the
    memory however many GPUs share the rest."""
    from course_utils.parallel3d.decide import decide
    from course_utils.plan import A100_80GB, Transformer

    wide = Transformer(4, 40960, 320, 2048, 51200, 64, name="wide")
    r = decide(wide, A100_80GB, 64)
    z3 = r["rows"][3]["prediction"]
    layer = wide.layer_params()
    psi = z3.detail["params_per_gpu"]
    assert z3.memory["model_states"] == pytest.approx(16 * psi / 64 + 2 * 2 * layer + 4 * layer)
    assert 8 * layer > A100_80GB.memory_bytes  # the gathered layers alone are too large
