"""Checks for notebook 10 (expert parallelism): top-k routing with capacity and the
load-balancing loss (10.1), and the dispatch and combine of an expert-parallel layer (10.2)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from ..comm.counting import CommunicationMode
from ..expert_parallel import apply, comm, router
from ..expert_parallel.layer import Expert
from .common import OnlyCommunication, fail, launch_check, no_store, passed, refuse_calls

PACKAGE_ROUTE = (
    "that is the package's route (course_utils.expert_parallel.route), which the check compares "
    "with: write the routing yourself"
)
PACKAGE_EP = (
    "that is the package's dispatch and combine (course_utils.expert_parallel), which the check "
    "compares with: write the sorting, the counts and the two all-to-alls yourself"
)


def _route_cases():
    g = torch.Generator().manual_seed(101)
    cases = []
    for T, E, k, cf in ((9, 4, 1, None), (12, 4, 2, None), (12, 4, 2, 1.0), (10, 6, 2, 0.5),
                        (7, 3, 1, 1.25), (16, 8, 2, 1.0)):  # fmt: skip
        logits = torch.randn(T, E, generator=g, dtype=torch.float64)
        logits[: T // 2, 0] += 2.0  # a popular expert, so that capacity bites
        cases.append((logits, k, cf))
    return cases


KEEP_MISTAKES = {  # a wrong keep that equals one of these is told which it is
    "none": " (you kept every assignment: capacity_factor limits each expert)",
    "floor": " (your capacity is rounded down: round it up)",
    "token-major": " (you gave places token by token, each token's k choices together)",
}


def _keep(experts, E, cf, how):
    """Which assignments are kept when places are given the way ``how`` says (a mistake)."""
    T, k = experts.shape
    if how == "none" or cf is None:
        return torch.ones(T, k, dtype=torch.bool)
    cap = router.capacity(T, E, k, cf)  # rounded up, as route() does
    if how == "floor":
        share = cf * T * k / E
        cap = math.floor(share + 1e-9 * max(1.0, share))  # a rounding error is not a fraction
    if how == "token-major":
        order = [(t, j) for t in range(T) for j in range(k)]
    else:  # every first choice in token order, then every second choice, ...
        order = [(t, j) for j in range(k) for t in range(T)]
    taken, keep = [0] * E, torch.zeros(T, k, dtype=torch.bool)
    for t, j in order:
        e = int(experts[t, j])
        if taken[e] < cap:
            taken[e], keep[t, j] = taken[e] + 1, True
    return keep


def check_route(route) -> None:
    """Exercise 10.1: ``route(logits, k, capacity_factor) -> (experts, weights, keep, aux_loss)``."""
    cases = []  # the answers, computed before the student's code runs
    for logits, k, cf in _route_cases():
        theirs = logits.clone().requires_grad_()
        want = router.route(theirs, k, cf)
        (ref,) = torch.autograd.grad(want.aux_loss, theirs)
        cases.append((logits, k, cf, want, ref))
    with refuse_calls("10.1", [router.route], PACKAGE_ROUTE):
        for logits, k, cf, want, ref in cases:
            mine = logits.clone().requires_grad_()
            got = route(mine, k, cf)
            where = f"T={logits.shape[0]} tokens, E={logits.shape[1]}, k={k}, capacity_factor={cf}"
            if not (isinstance(got, tuple) and len(got) == 4):
                fail("10.1", "return (experts, weights, keep, aux_loss)")
            experts, weights, keep, aux = got
            if not torch.equal(torch.as_tensor(experts).long(), want.experts):
                fail("10.1", f"with {where}, the experts differ: each token's k most probable, "
                     "most probable first")  # fmt: skip
            if not torch.allclose(
                torch.as_tensor(weights).double(), want.weights.detach(), atol=1e-12
            ):
                hint = (
                    "with k = 1 the weight is the probability itself (the Switch Transformer), "
                    "so that the router learns from the loss"
                    if k == 1
                    else "with k > 1 the k probabilities are renormalised to sum to 1"
                )
                fail("10.1", f"with {where}, the weights differ: {hint}")
            if not torch.equal(torch.as_tensor(keep).bool(), want.keep):
                said = next((why for how, why in KEEP_MISTAKES.items() if torch.equal(
                    torch.as_tensor(keep).bool(), _keep(want.experts, logits.shape[1], cf, how))),
                    "")  # fmt: skip
                fail("10.1", f"with {where}, the kept assignments differ{said}: an expert takes "
                     "ceil(capacity_factor · T·k / E) of them, every token's first choice in "
                     "token order before any second choice; None means no limit")  # fmt: skip
            # detached: torch warns when a tensor that needs a gradient becomes a Python float
            got_aux = float(aux.detach()) if torch.is_tensor(aux) else None
            if (
                got_aux is None
                or not abs(got_aux - float(torch.as_tensor(want.aux_loss).detach())) <= 1e-12
            ):
                fail("10.1", f"with {where}, the load-balancing loss differs: E · sum_i f_i · "
                     "P_i, f_i the share of the T·k assignments (before dropping), P_i the mean "
                     "probability")  # fmt: skip
            if aux.grad_fn is None:
                fail("10.1", "aux_loss has no gradient: it must be computed from the "
                     "probabilities, so that it can train the router")  # fmt: skip
            (grad,) = torch.autograd.grad(aux, mine)
            if not torch.allclose(grad, ref, atol=1e-12):
                fail("10.1", f"with {where}, aux_loss's gradient differs: f_i is a count (no "
                     "gradient), only P_i carries one")  # fmt: skip
    passed("10.1", "experts, weights, capacity and dropping, and the load-balancing loss with "
           "its gradient, on 6 routings")  # fmt: skip


def _ep_experts(ctx, E, T, h):
    """``E`` experts, the same on every rank (drawn from the case's seed)."""
    g = torch.Generator().manual_seed(7 * E + T)
    experts = [Expert(h, 2 * h).double() for _ in range(E)]
    for e in experts:
        for p in e.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        e.to(ctx.device)
    return experts


def _ep_reference(ctx, experts, E, T, h, k, cf):
    """The answer, on one process: every rank's tokens through the chosen experts (this rank's
    experts get gradient from all of them). Returns this rank's tokens, upstream gradient,
    routing, output and input gradient, and the rows this rank's experts get from every rank."""
    n, r = ctx.world_size, ctx.rank
    recv_rows = 0  # rows this rank's experts get from every rank
    for s in range(n):
        gx = torch.Generator().manual_seed(100 + s)  # each rank its own tokens
        xw = torch.randn(T + s, h, generator=gx, dtype=torch.float64).to(ctx.device)
        lg = torch.randn(T + s, E, generator=gx, dtype=torch.float64).to(ctx.device)
        up_s = torch.randn(xw.shape, generator=gx, dtype=torch.float64).to(ctx.device)
        lg[:, 0] -= 50.0  # expert 0 gets no token anywhere
        if s == 0:
            lg[:, E // n :] -= 50.0  # rank 0 sends nothing to the other ranks' experts
        rt = router.route(lg, k, cf)
        lo, hi = r * E // n, (r + 1) * E // n
        recv_rows += int((rt.keep & (rt.experts >= lo) & (rt.experts < hi)).sum())
        xw.requires_grad_()
        out = torch.zeros_like(xw)
        for t in range(len(xw)):
            for j in range(k):
                if rt.keep[t, j]:
                    e = int(rt.experts[t, j])
                    out[t] += rt.weights[t, j] * experts[e](xw[t : t + 1])[0]
        out.backward(up_s)
        if s == r:
            x, up, routing, want, x_grad = xw.detach(), up_s, rt, out.detach(), xw.grad
    return x, up, routing, want, x_grad, recv_rows


def _ep_student(dispatch_combine, xs, up, routing, mine, E, where):
    """The student's layer, forward and backward, with the package refused and only all-to-alls
    allowed. Returns its output, the all-to-alls forward issued (op name -> calls) and the input
    bytes of each."""
    sizes = []
    with contextlib.ExitStack() as watch:
        watch.enter_context(
            refuse_calls("10.2", [apply.dispatch_combine, comm.exchange_counts], PACKAGE_EP)
        )
        watch.enter_context(no_store("10.2"))
        c = watch.enter_context(
            OnlyCommunication(
                "10.2",
                ("alltoall_base_", "alltoall_", "all_to_all_single"),
                "expert parallelism moves tokens and counts with all-to-alls only",
            )  # fmt: skip
        )
        with contextlib.ExitStack() as forward:
            _count_a2a(forward, sizes)
            calls = dict(c.calls)
            got = dispatch_combine(xs, routing, torch.nn.ModuleList(mine), E, None)
            calls = {k_: v - calls.get(k_, 0) for k_, v in c.calls.items()}
        if not isinstance(got, torch.Tensor) or got.shape != xs.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            fail("10.2", f"with {where}, return (T, h) = {tuple(xs.shape)}; got {shape}")
        got.backward(up)
    return got, calls, sizes


def _judge_ep_values(where, r, got, want, xs, x_grad, mine, grads_want):
    """The output, the tokens' gradient and this rank's experts' gradients against one process."""
    err = float((got.detach() - want.detach()).abs().max())
    if not err <= 1e-12:  # a NaN fails too
        fail("10.2", f"with {where}, rank {r}'s output differs from one process by {err:.2g}: "
             "each kept assignment's row goes to its expert's rank, comes back in the same "
             "place, and is added to its token with its weight")  # fmt: skip
    if xs.grad is None or not float((xs.grad - x_grad).abs().max()) <= 1e-12:
        fail("10.2", f"with {where}, the tokens' gradient is wrong: use the package's "
             "all_to_all, whose backward sends each row's gradient back")  # fmt: skip
    for e, ws in zip(mine, grads_want):
        for p, w in zip(e.parameters(), ws):
            gp = torch.zeros_like(w) if p.grad is None else p.grad
            if not float((gp - w).abs().max()) <= 1e-12:
                fail("10.2", f"with {where}, rank {r}'s expert gradients differ: each local "
                     "expert must run on the rows every rank sent it")  # fmt: skip


def _ep_worker(ctx, dispatch_combine, cases):
    n, r = ctx.world_size, ctx.rank
    for E, T, h, k, cf in cases:
        experts = _ep_experts(ctx, E, T, h)
        mine = experts[r * E // n : (r + 1) * E // n]
        x, up, routing, want, x_grad, recv_rows = _ep_reference(ctx, experts, E, T, h, k, cf)
        grads_want = [
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in e.parameters()]
            for e in mine
        ]
        for e in experts:
            e.zero_grad()
        xs = x.clone().requires_grad_()
        rows = int(routing.keep.sum())
        where = f"{n} ranks, E={E}, k={k}, capacity_factor={cf}"
        got, calls, sizes = _ep_student(dispatch_combine, xs, up, routing, mine, E, where)
        _judge_ep_values(where, r, got, want, xs, x_grad, mine, grads_want)
        per_row = h * x.element_size()
        if sum(calls.values()) != 3 or sizes[1:] != [rows * per_row, recv_rows * per_row]:
            fail("10.2", f"with {where}, rank {r} issued {sum(calls.values())} all-to-alls "
                 f"with inputs of {sizes} bytes; the layer needs three: the counts, then each of "
                 f"its {rows} kept rows ({h} values each) out once, and the {recv_rows} rows its "
                 "experts received back once")  # fmt: skip
    dist.barrier()
    return True


class _AllToAllSizes(CommunicationMode):
    """Appends the input bytes of every all-to-all to ``sizes``."""

    def __init__(self, sizes: list):
        super().__init__()
        self.sizes = sizes

    def before(self, call) -> None:
        name, args = call.name, call.args
        if name in ("alltoall_base_", "alltoall_", "all_to_all_single"):
            x = {"alltoall_base_": [args[1]], "alltoall_": list(args[1])}.get(name, [args[0]])
            self.sizes.append(sum(t.numel() * t.element_size() for t in x))


def _count_a2a(watch, sizes):
    watch.enter_context(_AllToAllSizes(sizes))


def check_dispatch_combine(dispatch_combine) -> None:
    """Exercise 10.2: ``dispatch_combine(x, routing, local_experts, n_experts, group) -> y``."""
    cases = [(12, 10, 4, 2, None), (6, 9, 3, 1, 1.0), (12, 12, 2, 2, 0.75)]
    for n in (2, 3):
        launch_check("10.2", _ep_worker, n, dispatch_combine=dispatch_combine, cases=cases,
                     timeout=120)  # fmt: skip
    passed("10.2", "output and gradients equal to one process on 2 and 3 ranks (an expert with "
           "no token, a rank sending to nobody else), with three all-to-alls")  # fmt: skip


__all__ = ["check_dispatch_combine", "check_route"]
