"""Notebook 09's exercise checks (09.1 merge, 09.2 ring forward, 09.3 seq_to_head): each passes the
model answer and refuses the package's code, the library ops that would do the work, and the
typical mistakes, each with a hint."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from course_utils import checks
from course_utils.context_parallel import comm as cp_comm
from course_utils.context_parallel import ring_attention
from course_utils.context_parallel import softmax as cp_softmax
from course_utils.context_parallel.softmax import causal_block_attention
from tests.checks_support import fails, pasted

# make test-floor runs these on the oldest torch too: functional collectives and the dispatch-mode watchers
pytestmark = [pytest.mark.floor]


# ---- 09.1 merge ---------------------------------------------------------------------------------


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)  # (B, H, Sq)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def merge_nan_on_blind_rows(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[
        ..., None
    ] * out_b, lse


def merge_by_exp_sums(out_a, lse_a, out_b, lse_b):
    sa, sb = torch.exp(lse_a), torch.exp(lse_b)  # overflows in float32 for large scores
    return (sa[..., None] * out_a + sb[..., None] * out_b) / (sa + sb)[..., None], torch.log(
        sa + sb
    )


def merge_unweighted(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def test_09_1_merge(capsys):
    checks.check_merge(merge)
    assert "✓ exercise 09.1" in capsys.readouterr().out
    fails(checks.check_merge, cp_softmax.merge, "package's merge")

    def in_a_thread(*args):  # the refusal swaps the function's code: every thread sees it
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(cp_softmax.merge, *args).result()

    fails(checks.check_merge, in_a_thread, "package's merge")
    # a pasted copy is the student's code now, judged by what it computes (calls are refused,
    # copies are not policed)
    checks.check_merge(pasted(cp_softmax.merge, "my_merge", docstring=False))
    fails(checks.check_merge, merge_nan_on_blind_rows, "lse = -inf")
    fails(checks.check_merge, merge_by_exp_sums, "inf or nan")
    fails(checks.check_merge, merge_unweighted, "weight each block's output")


# ---- 09.2 ring forward -------------------------------------------------------------------------


def ring_forward(q, k, v, pos, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = ((r + d) % n for d in (1, -1))
    if group is not None:  # P2POp takes global ranks
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for step in range(n):
        src = (r - step) % n  # whose K and V this rank holds now
        if step < n - 1:  # pass them on while computing with them
            k_next, v_next = torch.empty_like(k), torch.empty_like(v)
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
                dist.P2POp(dist.irecv, k_next, prv, group), dist.P2POp(dist.irecv, v_next, prv, group),
            ])  # fmt: skip
        o, s, _ = causal_block_attention(q, k, v, pos[r], pos[src])
        out, lse = merge(out, lse, o, s)
        if step < n - 1:
            for w in works:
                w.wait()
            k, v = k_next, v_next
    return out


def _pass_on(k, v, r, n):
    """One hop of the ring, written out in the wrong answers below (not the package's)."""
    k_next, v_next = torch.empty_like(k), torch.empty_like(v)
    for w in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, k, (r + 1) % n), dist.P2POp(dist.isend, v, (r + 1) % n),
        dist.P2POp(dist.irecv, k_next, (r - 1) % n), dist.P2POp(dist.irecv, v_next, (r - 1) % n),
    ]):  # fmt: skip
        w.wait()
    return k_next, v_next


def ring_one_hop_too_many(q, k, v, pos, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for step in range(n):
        src = (r - step) % n
        o, s, _ = causal_block_attention(q, k, v, pos[r], pos[src])
        out, lse = merge(out, lse, o, s)
        k, v = _pass_on(k, v, r, n)
    return out


def ring_by_all_gather(q, k, v, pos, group=None):
    n = dist.get_world_size(group)
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return cp_softmax.attention(q, torch.cat(ks, 2), torch.cat(vs, 2), True,
                                pos[dist.get_rank()], torch.cat(pos))  # fmt: skip


def ring_with_own_positions(q, k, v, pos, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for step in range(n):
        o, s, _ = causal_block_attention(q, k, v, pos[r], pos[r])  # the keys' positions: wrong
        out, lse = merge(out, lse, o, s)
        if step < n - 1:
            k, v = _pass_on(k, v, r, n)
    return out


def ring_via_package(q, k, v, pos, group=None):
    return ring_attention(q, k, v, pos, group, True)


def test_09_2_ring_forward(runs_root, capsys):
    checks.check_ring_forward(ring_forward)
    assert "✓ exercise 09.2" in capsys.readouterr().out
    fails(checks.check_ring_forward, ring_via_package, "package's ring attention")
    fails(checks.check_ring_forward, ring_one_hop_too_many, "n - 1 = 1 times")
    fails(checks.check_ring_forward, ring_by_all_gather, "point-to-point sends only")
    fails(checks.check_ring_forward, ring_with_own_positions, "differs from full causal")


# ---- 09.3 seq_to_head --------------------------------------------------------------------------


def seq_to_head(x, group=None):
    p = dist.get_world_size(group)
    send = torch.stack(x.chunk(p, dim=1))  # (P, B, H/P, s, D): chunk j = rank j's heads
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's tokens of my heads
    return torch.cat(list(recv), dim=2)  # (B, H/P, P·s, D)


def seq_to_head_tokens_interleaved(x, group=None):
    p = dist.get_world_size(group)
    send = torch.stack(x.chunk(p, dim=1))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 3, 0, 4).flatten(2, 3)  # tokens of the ranks interleaved: wrong


def seq_to_head_by_all_gather(x, group=None):
    p, r = dist.get_world_size(group), dist.get_rank(group)
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x)
    return torch.cat(parts, 2).chunk(p, 1)[r]


def test_09_3_seq_to_head(runs_root, capsys):
    checks.check_seq_to_head(seq_to_head)
    assert "✓ exercise 09.3" in capsys.readouterr().out
    fails(checks.check_seq_to_head, cp_comm._seq_to_head, "package's seq_to_head")
    fails(checks.check_seq_to_head, seq_to_head_tokens_interleaved, "out of order")
    fails(checks.check_seq_to_head, seq_to_head_by_all_gather, "one all-to-all")
