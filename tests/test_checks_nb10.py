"""Notebook 10's exercise checks (10.1 route, 10.2 dispatch and combine): each passes the model
answer and refuses the package's code, the library ops that would do the work, and the typical
mistakes, each with a hint."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from course_utils import checks
from course_utils.expert_parallel import all_to_all, dispatch_combine, route
from tests.checks_support import fails, pasted

# make test-floor runs these on the oldest torch too: functional collectives and the dispatch-mode watchers
pytestmark = [pytest.mark.floor]


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
