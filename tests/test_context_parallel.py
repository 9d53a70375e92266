"""Context parallelism: the online softmax, the layouts' work, and ring attention, Ulysses and the
all-gathered K/V, forward and backward, equal to one process (float64) on 2 and 4 ranks, with the
bytes each sends counted against the formulas; a whole GPT trained with each against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.comm import CollectiveCounter, ring_bytes
from course_utils.context_parallel import (
    apply_cp,
    attention,
    block_attention,
    merge,
    positions,
    values_per_rank,
    work_per_rank,
)
from course_utils.context_parallel.comm import Ring, seq_to_head
from course_utils.context_parallel.parity import cp_parity_worker
from course_utils.context_parallel.ring import ring_attention
from course_utils.context_parallel.softmax import causal_block_attention
from course_utils.context_parallel.ulysses import allgather_attention, ulysses_attention
from course_utils.models import GPT, GPTConfig

# make test-floor runs these on the oldest torch too: batch_isend_irecv and all_to_all_single under autograd
pytestmark = [pytest.mark.floor]

TOL = 1e-12


def test_merge_of_blocks_equals_one_softmax_even_for_rows_that_see_nothing():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(8)
    # keys 4..7 against queries 0..7: queries 0..3 see nothing there (lse = -inf, out = 0)
    o1, l1, _ = causal_block_attention(q, k[..., :4, :], v[..., :4, :], pos, pos[:4])
    o2, l2, _ = causal_block_attention(q, k[..., 4:, :], v[..., 4:, :], pos, pos[4:])
    assert torch.isinf(l2[..., :4]).all() and (o2[..., :4, :] == 0).all()
    out, lse = merge(o1, l1, o2, l2)
    assert (out - attention(q, k, v, causal=True)).abs().max() < TOL
    out, _ = merge(o2, l2, o1, l1)
    assert (out - attention(q, k, v, causal=True)).abs().max() < TOL
    # two blocks where a row sees nothing in either: stays 0, not nan
    none = torch.zeros(8, 4, dtype=torch.bool)
    oa, la = block_attention(q, k[..., :4, :], v[..., :4, :], none)
    out, lse = merge(oa, la, oa, la)
    assert not out.isnan().any() and (out == 0).all() and torch.isinf(lse).all()


def test_merge_in_float32_does_not_overflow_at_large_scores():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 4, 8) * 40  # scores in the hundreds: exp overflows float32
    k, v = torch.randn(1, 1, 8, 8) * 40, torch.randn(1, 1, 8, 8)
    o1, l1 = block_attention(q, k[..., :4, :], v[..., :4, :])
    o2, l2 = block_attention(q, k[..., 4:, :], v[..., 4:, :])
    out, _ = merge(o1, l1, o2, l2)
    want = attention(q.double(), k.double(), v.double(), causal=False)
    assert torch.isfinite(out).all() and (out.double() - want).abs().max() < 1e-4


def test_layouts_and_their_causal_work():
    assert [p.tolist() for p in positions("zigzag", 2, 8)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [p.tolist() for p in positions("contiguous", 2, 4)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="seq_len=12 is not a multiple of 8"):
        positions("zigzag", 4, 12)
    with pytest.raises(ValueError, match="layout must be one of"):
        positions("striped", 2, 8)
    for n in (2, 4, 8):
        naive, zz = work_per_rank("contiguous", n, 64 * n), work_per_rank("zigzag", n, 64 * n)
        c = 64  # contiguous: rank i computes i full blocks and one diagonal one
        assert naive == [(i + 1) * c * c for i in range(n)]  # the last rank n times the first
        assert len(set(zz)) == 1  # zig-zag: the same for every rank
        assert sum(zz) <= sum(naive)
    assert work_per_rank("zigzag", 2, 16, causal=False) == [128, 128]


def _attention_worker(ctx, H=4, B=2, S=16, D=4):
    from course_utils.context_parallel import (
        allgather_attention,
        ring_attention,
        shard,
        ulysses_attention,
    )

    n, r = ctx.world_size, ctx.rank
    gen = torch.Generator().manual_seed(3)  # the same whole tensors on every rank
    q, k, v, dout = (
        torch.randn(B, H, S, D, generator=gen, dtype=torch.float64).to(ctx.device) for _ in range(4)
    )
    fns = {"ring": ring_attention, "ulysses": ulysses_attention, "allgather": allgather_attention}
    errs, sent = {}, {}
    for causal in (True, False):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        want = attention(qr, kr, vr, causal)
        want.backward(dout)
        for layout in ("contiguous", "zigzag"):
            pos = positions(layout, n, S)
            for name, fn in fns.items():
                ql, kl, vl = (shard(t, pos[r], 2).requires_grad_() for t in (q, k, v))
                with CollectiveCounter(p2p=True) as fwd:
                    out = fn(ql, kl, vl, pos, None, causal)
                with CollectiveCounter(p2p=True) as bwd:
                    out.backward(shard(dout, pos[r], 2))
                pairs = [
                    (out, shard(want, pos[r], 2)),
                    (ql.grad, shard(qr.grad, pos[r], 2)),
                    (kl.grad, shard(kr.grad, pos[r], 2)),
                    (vl.grad, shard(vr.grad, pos[r], 2)),
                ]
                errs[name, layout, causal] = max(float((a - b).abs().max()) for a, b in pairs)
                sent[name] = {
                    phase: sum(ring_bytes(kind, nb, n) for kind, nb in c.calls) / 8
                    for phase, c in (("forward", fwd), ("backward", bwd))
                }
    dist.barrier()
    return {"errs": errs, "sent": sent}


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_ulysses_allgather_equal_one_process_and_send_what_the_formulas_say(
    runs_root, world_size
):
    B, H, S, D = 2, 4, 16, 4
    res = launch(_attention_worker, world_size, H=H, B=B, S=S, D=D, echo=False).results
    for rank, out in enumerate(res):
        bad = {key: e for key, e in out["errs"].items() if e > TOL}
        assert not bad, f"rank {rank}: {bad}"
        for method, sent in out["sent"].items():
            want = values_per_rank(method, B, S, H * D, world_size)
            assert sent == pytest.approx(want), (rank, method, sent, want)


def _refusals_worker(ctx):
    out = {}
    try:
        seq_to_head(torch.zeros(1, 3, 4, 2, device=ctx.device), None)
        out["heads"] = "accepted"
    except ValueError as e:
        out["heads"] = str(e)
    # 7 tokens split 4 + 3: the ranks would post receives of different sizes (gloo aborts)
    pos = [torch.arange(0, 4), torch.arange(4, 7)]
    q = torch.randn(1, 2, len(pos[ctx.rank]), 4, device=ctx.device)
    for name, fn in (("ring", ring_attention), ("ulysses", ulysses_attention),
                     ("allgather", allgather_attention)):  # fmt: skip
        try:
            fn(q, q, q, pos, None, True)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    dist.barrier()  # every rank got here: none is stuck in a collective
    return out


def test_refusals_ulysses_heads_and_unequal_shards_on_every_rank(runs_root):
    res = launch(_refusals_worker, 2, echo=False, timeout=60).results
    assert "H=3 heads" in res[0]["heads"] and "divides 3" in res[0]["heads"]
    for out in res:
        for name in ("ring", "ulysses", "allgather"):
            assert "the same number of tokens on every rank" in out[name], (name, out[name])
            assert "4, 3 tokens to ranks 0..1" in out[name]


def _ring_worker(ctx):
    """A ring over the world (4 ranks) and over ranks 1, 2, 3 (a group of 3, whose neighbours
    are global ranks other than the group ranks): each rank sends its own rank."""
    sub = dist.new_group([1, 2, 3])
    got = {}
    for name, group in (("world", None), ("sub", sub)):
        if group is not None and ctx.rank == 0:
            continue
        ring = Ring(group)
        (buf,) = ring.start(torch.tensor([float(ctx.rank)], device=ctx.device))
        ring.wait()
        got[name] = {"next": ring.next, "prev": ring.prev, "received": int(buf.item())}
    return got


def test_the_ring_sends_to_the_next_global_rank_and_receives_from_the_previous(runs_root):
    res = launch(_ring_worker, 4, echo=False, timeout=60).results
    for r, got in enumerate(res):
        assert got["world"] == {"next": (r + 1) % 4, "prev": (r - 1) % 4, "received": (r - 1) % 4}
    members = [1, 2, 3]  # in a group of 3, next and previous are different ranks
    for i, r in enumerate(members):
        prev, nxt = members[(i - 1) % 3], members[(i + 1) % 3]
        assert res[r]["sub"] == {"next": nxt, "prev": prev, "received": prev}


GPT_CASES = {2: [("ring", "zigzag"), ("ulysses", "contiguous"), ("allgather", "zigzag")],
             4: [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")]}  # fmt: skip


def _gpt_cases(ctx, cfg, cases):
    return [cp_parity_worker(ctx, cfg=cfg, method=m, layout=lay) for m, lay in cases]


@pytest.mark.parametrize("world_size", list(GPT_CASES))
def test_a_gpt_trained_with_context_parallelism_equals_one_process(runs_root, world_size):
    """Every case of GPT_CASES in one launch per world size."""
    cfg = GPTConfig(vocab=32, seq_len=16, d_model=16, n_heads=4, n_layers=2)
    cases = GPT_CASES[world_size]
    res = launch(_gpt_cases, world_size, cfg=cfg, cases=cases, echo=False).results
    for i, case in enumerate(cases):
        for out in (per_rank[i] for per_rank in res):
            assert out["loss"] < TOL and out["params"] < TOL, (case, out)


def _apply_refusals(ctx):
    out = {}
    for cfg, method in (
        (GPTConfig(dropout=0.1), "ring"),
        (GPTConfig(n_heads=3, d_model=12), "ulysses"),
    ):
        try:
            apply_cp(GPT(cfg), method, "contiguous")
            out[method] = "accepted"
        except ValueError as e:
            out[method] = str(e)
    return out


def test_apply_cp_refuses_dropout_and_heads_it_cannot_split(runs_root):
    out = launch(_apply_refusals, 2, echo=False).results[0]
    assert "dropout=0.0" in out["ring"]
    assert "3 heads" in out["ulysses"]


def test_gpt_positions_argument():
    cfg = GPTConfig(vocab=16, seq_len=8, d_model=8, n_heads=2, n_layers=1)
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(16, (2, 8))
    assert torch.equal(model(ids), model(ids, positions=torch.arange(8)))
    with pytest.raises(ValueError, match="below seq_len=8"):
        model(ids[:, :2], positions=torch.tensor([3, 8]))
