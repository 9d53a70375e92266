"""The checks of notebooks 09 and 10: each passes the model answer and refuses the package's code,
copies of it, the library ops that would do the work, and the typical mistakes, each with a hint."""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from course_utils import checks
from course_utils.checks import ExerciseError
from course_utils.context_parallel import comm as cp_comm
from course_utils.context_parallel import ring_attention
from course_utils.context_parallel import softmax as cp_softmax
from course_utils.context_parallel.softmax import causal_block_attention
from course_utils.expert_parallel import all_to_all, dispatch_combine, route

# make test-floor runs these on the oldest torch too: functional collectives and the dispatch-mode watchers
pytestmark = [pytest.mark.floor]


def fails(check, answer, hint: str) -> str:
    with pytest.raises(ExerciseError) as info:
        check(answer)
    assert hint in str(info.value), str(info.value)
    return str(info.value)


def pasted(fn, name, docstring: bool = True):
    """``fn``'s source pasted under another name, as a student might copy it from the package
    (``docstring=False``: without its docstring)."""
    src = textwrap.dedent(inspect.getsource(fn)).replace(f"def {fn.__name__}(", f"def {name}(")
    if not docstring and fn.__doc__:
        tree = ast.parse(src)
        tree.body[0].body = tree.body[0].body[1:]  # the docstring is the first statement
        src = ast.unparse(tree)
    ns = dict(vars(inspect.getmodule(fn)))
    exec(compile(src, "<cell>", "exec"), ns)
    return ns[name]


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


# ---- 10.1 route --------------------------------------------------------------------------------


def my_route(logits, k, capacity_factor=None):
    T, E = logits.shape
    probs = torch.softmax(logits, dim=-1)  # (T, E)
    top, experts = probs.topk(k, dim=-1)  # (T, k)
    weights = top / top.sum(-1, keepdim=True) if k > 1 else top
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * T * k / E)
        taken = [0] * E
        for j in range(k):  # every first choice, in token order, then every second
            for t in range(T):
                e = int(experts[t, j])
                keep[t, j] = taken[e] < cap
                taken[e] += 1
    f = torch.bincount(experts.flatten(), minlength=E).to(probs.dtype) / (T * k)
    aux = E * (f * probs.mean(0)).sum()
    return experts, weights, keep, aux


def route_token_major(logits, k, capacity_factor=None):
    experts, weights, keep, aux = my_route(logits, k, None)
    if capacity_factor is not None:
        T, E = logits.shape
        cap, taken = math.ceil(capacity_factor * T * k / E), [0] * E
        for t in range(T):  # a token's choices together: not the order GShard and Switch use
            for j in range(k):
                e = int(experts[t, j])
                keep[t, j] = taken[e] < cap
                taken[e] += 1
    return experts, weights, keep, aux


def route_normalised_top1(logits, k, capacity_factor=None):
    experts, weights, keep, aux = my_route(logits, k, capacity_factor)
    return experts, weights / weights.sum(-1, keepdim=True), keep, aux


def route_aux_detached(logits, k, capacity_factor=None):
    experts, weights, keep, aux = my_route(logits, k, capacity_factor)
    return experts, weights, keep, aux.detach()


def route_package_tuple(logits, k, capacity_factor=None):
    r = route(logits, k, capacity_factor)
    return r.experts, r.weights, r.keep, r.aux_loss


def test_10_1_route(capsys):
    with warnings.catch_warnings():  # the check itself warns about nothing (seen on a GPU run)
        warnings.simplefilter("error")
        checks.check_route(my_route)
    assert "✓ exercise 10.1" in capsys.readouterr().out
    fails(checks.check_route, route_package_tuple, "package's route")
    # a copy of the package's route is judged by what it returns (the package returns a Routing)
    fails(checks.check_route, pasted(route, "routing"), "return (experts, weights, keep, aux_loss)")
    fails(checks.check_route, route_token_major, "first choice in token order")
    fails(checks.check_route, route_normalised_top1, "k = 1 the weight is the probability")
    fails(checks.check_route, route_aux_detached, "no gradient")


# ---- 10.2 dispatch and combine -----------------------------------------------------------------


def my_dispatch_combine(x, routing, local_experts, n_experts, group=None):
    n = dist.get_world_size(group)
    per_rank = n_experts // n
    t, j = torch.nonzero(routing.keep, as_tuple=True)  # kept assignments
    e = routing.experts[t, j]
    order = torch.argsort(e, stable=True)  # by expert, hence by the rank that holds it
    t, j, e = t[order], j[order], e[order]
    counts = torch.bincount(e, minlength=n_experts).view(n, per_rank)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)  # got[s, l]: rows from rank s for expert l
    send, recv = counts.sum(1).tolist(), got.sum(1).tolist()
    rows = all_to_all(x[t], send, recv, group)  # by source rank, then by my expert
    owner = torch.arange(per_rank, device=x.device).repeat(n).repeat_interleave(got.flatten())
    out = torch.zeros_like(rows)
    for le, expert in enumerate(local_experts):
        idx = (owner == le).nonzero(as_tuple=True)[0]
        out = out.index_copy(0, idx, expert(rows[idx]))
    back = all_to_all(out, recv, send, group)
    return torch.zeros_like(x).index_add(0, t, routing.weights[t, j, None] * back)


def dispatch_without_weights(x, routing, local_experts, n_experts, group=None):
    ones = type(routing)(routing.experts, torch.ones_like(routing.weights), routing.keep,
                         routing.aux_loss, routing.counts, routing.capacity)  # fmt: skip
    return my_dispatch_combine(x, ones, local_experts, n_experts, group)


def dispatch_by_all_gather(x, routing, local_experts, n_experts, group=None):
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(x)], device=x.device))
    return my_dispatch_combine(x, routing, local_experts, n_experts, group)


def test_10_2_dispatch_combine(runs_root, capsys):
    checks.check_dispatch_combine(my_dispatch_combine)
    assert "✓ exercise 10.2" in capsys.readouterr().out
    fails(checks.check_dispatch_combine, dispatch_combine, "package's dispatch and combine")
    fails(checks.check_dispatch_combine, dispatch_without_weights, "with its weight")
    fails(checks.check_dispatch_combine, dispatch_by_all_gather, "all-to-alls only")
