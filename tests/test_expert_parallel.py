"""Expert parallelism: routing by hand (capacity order, weights, the load-balancing loss), the MoE
layer against a token-by-token loop, and EP alone and with DP trained against one process in
float64 on 2 and 4 ranks, with uneven token counts per expert, dropping on and off."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.comm import CollectiveCounter
from course_utils.expert_parallel import (
    MoE,
    MoEConfig,
    all_to_all,
    all_to_all_values,
    apply_ep,
    moe_params,
    route,
)
from course_utils.expert_parallel.parity import ep_parity_worker
from course_utils.expert_parallel.router import capacity

# make test-floor runs these on the oldest torch too: all_to_all_single with uneven splits (gloo's in the floor lacks the list form)
pytestmark = [pytest.mark.floor]

TOL = 1e-12


def test_route_by_hand_capacity_goes_to_first_choices_first():
    # 4 tokens, 2 experts, k=2: token 0..2 prefer expert 0, token 3 prefers expert 1
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    r = route(logits, k=2, capacity_factor=0.75)  # C = ceil(0.75 * 4 * 2 / 2) = 3
    assert r.capacity == 3
    assert r.experts.tolist() == [[0, 1], [0, 1], [0, 1], [1, 0]]
    # expert 0: first choices of tokens 0, 1, 2 fill it; token 3's second choice is dropped
    # expert 1: token 3's first choice, then the second choices of tokens 0 and 1; token 2's dropped
    assert r.keep.tolist() == [[True, True], [True, True], [True, False], [True, False]]
    assert r.counts.tolist() == [3, 3]
    p = torch.softmax(logits, -1)
    assert torch.allclose(r.weights, p.gather(1, r.experts))  # k = E: weights are the probabilities
    f = torch.tensor([4 / 8, 4 / 8])
    assert torch.allclose(r.aux_loss, 2 * (f * p.mean(0)).sum())


def test_route_weights_normalised_for_top2_raw_for_top1_and_aux_gradient_through_p_only():
    torch.manual_seed(0)
    logits = torch.randn(6, 4, requires_grad=True)
    r2, r1 = route(logits, 2), route(logits, 1)
    assert torch.allclose(r2.weights.sum(-1), torch.ones(6))
    assert torch.allclose(r1.weights[:, 0], torch.softmax(logits, -1).max(-1).values)
    assert r2.keep.all() and r2.capacity is None  # no capacity: nothing dropped
    even = route(torch.zeros(8, 4) + torch.eye(4).repeat(2, 1), 1)  # each expert 2 tokens
    assert float(even.aux_loss) == pytest.approx(1.0, abs=0.05)
    r2.aux_loss.backward()
    f = torch.bincount(r2.experts.flatten(), minlength=4) / 12  # a count: no gradient
    again = logits.detach().clone().requires_grad_()
    (4 * (f * torch.softmax(again, -1).mean(0)).sum()).backward()
    assert torch.allclose(logits.grad, again.grad) and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="1 <= k <= E=4"):
        route(logits, 5)


def test_moe_equals_a_loop_over_tokens_and_dropped_tokens_get_nothing():
    cfg = MoEConfig(d_model=8, n_experts=4, top_k=2, capacity_factor=0.5)
    torch.manual_seed(0)
    moe = MoE(cfg).double()
    x = torch.randn(10, 8, dtype=torch.float64)
    y = moe(x)
    r = moe.routing
    assert not r.keep.all()  # capacity 0.5: some dropped
    for t in range(10):
        want = sum(
            r.weights[t, j] * moe.experts[int(r.experts[t, j])](x[t : t + 1])[0]
            for j in range(2)
            if r.keep[t, j]
        )
        assert torch.allclose(y[t], torch.as_tensor(want, dtype=y.dtype), atol=TOL)


def test_mixtral_total_and_active_parameters():
    p = moe_params(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, experts=8, k=2,
                   vocab=32000)  # fmt: skip
    assert round(p["total"] / 1e9, 1) == 46.7 and round(p["active"] / 1e9, 1) == 12.9


EP_CASES = {  # world size: (ep, capacity_factor, tokens), each trained in the same launch
    2: [(2, None, 12), (2, 1.0, 12), (1, None, 12)],
    4: [(4, None, 12), (2, None, 12), (2, 1.0, 12)],
    3: [(3, 1.0, 0)],  # rank r trains on tokens + r tokens: rank 0 on none
}


def _ep_cases(ctx, cases):
    out = []
    for ep, capacity_factor, tokens in cases:
        cfg = MoEConfig(d_model=8, n_experts=4 if ep != 3 else 3, top_k=2,
                        capacity_factor=capacity_factor)  # fmt: skip
        out.append(ep_parity_worker(ctx, cfg=cfg, ep=ep, tokens=tokens))
    return out


@pytest.mark.parametrize("world_size", list(EP_CASES))
def test_expert_parallel_alone_and_with_dp_equals_one_process(runs_root, world_size):
    """EP alone and with EDP, with and without dropping; with ``tokens=0`` rank 0 has no tokens,
    and its load-balancing loss (in the loss) must add nothing, not NaN."""
    cases = EP_CASES[world_size]
    res = launch(_ep_cases, world_size, cases=cases, echo=False).results
    for i, (ep, capacity_factor, tokens) in enumerate(cases):
        outs = [per_rank[i] for per_rank in res]
        for out in outs:
            assert out["loss"] < TOL and out["params"] < TOL, (ep, capacity_factor, tokens, out)
        if ep > 1:  # the experts' loads differ (uneven batches, random routing)
            rows = [r for out in outs for step in out["expert_rows"] for r in step]
            assert len(set(rows)) > 1


def _a2a_worker(ctx):
    n, r = ctx.world_size, ctx.rank
    send = [0 if j == r else (r + 1) * (j + 1) for j in range(n)]  # none to itself, uneven
    x = torch.arange(sum(send), dtype=torch.float64, device=ctx.device).unsqueeze(1) + 100 * r
    recv = [0 if j == r else (j + 1) * (r + 1) for j in range(n)]
    xs = x.clone().requires_grad_()
    with CollectiveCounter() as c:
        out = all_to_all(xs, send, recv)
    (out * (1 + torch.arange(len(out), device=ctx.device).unsqueeze(1))).sum().backward()
    return {"out": out.detach().flatten().tolist(), "grad_rows": xs.grad.shape[0],
            "calls": c.calls}  # fmt: skip


def test_all_to_all_uneven_and_empty_splits_forward_and_backward(runs_root):
    res = launch(_a2a_worker, 3, echo=False).results
    for r, out in enumerate(res):
        want = []
        for j in range(3):
            if j != r:  # rank j's block for r: rows after j's blocks for ranks before r
                start = sum(0 if q == j else (j + 1) * (q + 1) for q in range(r))
                want += [start + i + 100 * j for i in range((j + 1) * (r + 1))]
        assert out["out"] == want
        assert out["grad_rows"] == sum(0 if j == r else (r + 1) * (j + 1) for j in range(3))
        assert [k for k, _ in out["calls"]] == ["all_to_all"]


def _traffic_worker(ctx, tokens, h):
    cfg = MoEConfig(d_model=h, n_experts=2 * ctx.world_size, top_k=2)
    torch.manual_seed(0)
    moe = MoE(cfg).double().to(ctx.device)
    with torch.no_grad():  # an even router: token i to experts i and i+1 (mod E)
        moe.router.weight.zero_()
    apply_ep(moe, None)
    x = torch.randn(tokens, h, dtype=torch.float64, device=ctx.device)
    original = moe.route

    def even(x2):
        r = original(x2)
        T, E = x2.shape[0], cfg.n_experts
        r.experts = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1).to(x2.device)
        return r

    moe.route = even
    with CollectiveCounter() as c:
        moe(x)
    return {"sent_rows": moe.stats["sent_rows"], "calls": c.calls}


@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_sends_what_the_formula_says_under_an_even_load(runs_root, world_size):
    tokens, h = 8 * world_size, 4
    res = launch(_traffic_worker, world_size, tokens=tokens, h=h, echo=False).results
    want = all_to_all_values(tokens, 2, h, world_size)
    for out in res:
        assert out["sent_rows"] * h == pytest.approx(want["dispatch"])
        kinds = [k for k, _ in out["calls"]]
        assert kinds == ["all_to_all"] * 3  # counts, dispatch, combine


def _refuse_worker(ctx):
    try:
        apply_ep(MoE(MoEConfig(n_experts=3)), None)
    except ValueError as e:
        return str(e)
    dist.barrier()
    return "accepted"


def test_apply_ep_refuses_experts_the_group_cannot_split(runs_root):
    assert "E=3" in launch(_refuse_worker, 2, echo=False).results[0]


def test_capacity_rounds_up_a_fraction_but_not_a_rounding_error():
    assert capacity(10, 4, 1, 1.25) == 4  # 3.125 places: rounded up
    assert capacity(50, 5, 1, 1.1) == 11  # 1.1 · 50 / 5 = 11, though floats give 11.000000000000002
    assert capacity(50, 5, 2, 1.1) == 22 and capacity(100, 5, 1, 1.1) == 22
    assert capacity(7, 3, 1, 1.25) == 3 and capacity(12, 4, 2, None) is None
    logits = torch.zeros(50, 5)
    logits[:, 0] = 1.0  # every token's first choice is expert 0
    r = route(logits, k=1, capacity_factor=1.1)
    assert r.capacity == 11 and int(r.keep.sum()) == 11


def test_route_of_no_tokens_has_a_zero_aux_loss_that_keeps_the_graph():
    logits = torch.zeros(0, 4, requires_grad=True)
    r = route(logits, k=2, capacity_factor=1.0)
    assert r.experts.shape == (0, 2) and r.counts.tolist() == [0, 0, 0, 0]
    assert float(r.aux_loss.detach()) == 0.0 and r.aux_loss.requires_grad
    r.aux_loss.backward()
    assert logits.grad is not None and logits.grad.shape == (0, 4)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5])
def test_moe_config_refuses_a_capacity_factor_that_is_not_positive(bad):
    with pytest.raises(ValueError, match=f"capacity_factor must be > 0, got {bad}"):
        MoEConfig(capacity_factor=bad)
