"""Checks for notebook 03 (DDP): ring all-reduce from point-to-point, and bucketed DDP overlapped
with backward (unused parameters included)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..comm.counting import CommunicationMode
from ..data_parallel import BucketedDDP
from ..models import RankDependentMLP, TiedMLP, ToyMLP, UnusedParamMLP
from .common import (
    ExerciseError,
    OnlyCommunication,
    fail,
    launch_check,
    no_store,
    passed,
    patched_methods,
    refuse_calls,
)


def _ring_worker(ctx, ring_all_reduce, sizes, dtypes):
    n, r = ctx.world_size, ctx.rank
    sent = {"elements": 0, "elsewhere": None}

    def counting(send):
        def counting_send(group, tensors, dst, tag=0):  # every point-to-point send ends here
            sent["elements"] += sum(t.numel() for t in tensors)
            # one direction, either way round the ring: every send to the same neighbour
            sent.setdefault("to", dst)
            if (dst not in ((r + 1) % n, (r - 1) % n) or dst != sent["to"]) and sent[
                "elsewhere"
            ] is None:
                sent["elsewhere"] = dst
            return send(group, tensors, dst, tag)

        return counting_send

    with patched_methods(dist.ProcessGroup, {"send": counting}):
        for numel in sizes:
            for dtype in dtypes:
                g = torch.Generator().manual_seed(1000 * r + numel)
                t = torch.randn(numel, generator=g, dtype=dtype).to(ctx.device)
                before = t.clone()
                ref = t.clone()
                dist.all_reduce(ref)
                sent["elements"], sent["elsewhere"] = 0, None
                sent.pop("to", None)
                with OnlyCommunication("03.1", ("send", "recv_"), NOT_A_RING), no_store("03.1"):
                    ring_all_reduce(t)
                if sent["elsewhere"] is not None:
                    fail("03.1", f"rank {r} sent to rank {sent['elsewhere']}: in a ring every "
                         f"rank sends only to one neighbour, the same every time (rank "
                         f"{(r + 1) % n} on the right, or rank {(r - 1) % n} on the left)")  # fmt: skip
                where = f"{n} ranks, {numel} elements, {str(dtype).replace('torch.', '')}"
                tol = 1e-12 if dtype == torch.float64 else 1e-4
                if not torch.allclose(t, ref, rtol=tol, atol=tol):
                    chunks_ok = [
                        torch.allclose(a, b, rtol=tol, atol=tol)
                        for a, b in zip(t.chunk(n), ref.chunk(n))
                    ]
                    if torch.equal(t, before):
                        hint = "t did not change: the ring works on t's chunks, in place"
                    elif torch.allclose(t * n, ref, rtol=tol, atol=tol):
                        hint = f"your result is the sum divided by {n}: all-reduce sums, as dist.all_reduce does"
                    elif any(chunks_ok):
                        hint = (
                            f"{sum(chunks_ok)} of {n} chunks are right: after the reduce-scatter each "
                            "rank owns one fully summed chunk (which one depends on your ring), and the all-gather "
                            "must carry every chunk around the ring"
                        )
                    else:
                        hint = (
                            "in the reduce-scatter, each step adds the chunk that arrives from the "
                            "left into your copy of that same chunk"
                        )
                    raise ExerciseError(
                        f"exercise 03.1: with {where}, your result differs from all_reduce by "
                        f"{(t - ref).abs().max().item():.3g}: {hint}."
                    )
                expected = 2 * (n - 1) * numel // n
                if sent["elements"] != expected:
                    raise ExerciseError(
                        f"exercise 03.1: with {where}, rank {r} sent {sent['elements']} elements; "
                        f"a ring sends 2(n-1) chunks of N/n elements. Use exchange() for every step."
                    )
    return True


NOT_A_RING = (
    "your ring called one of torch.distributed's collectives, which does the whole job (or half "
    "of it) for you; build every step from exchange(), the point-to-point messages"
)


def check_ring_all_reduce(ring_all_reduce) -> None:
    """Exercise 03.1: ``ring_all_reduce(t)`` sums ``t`` over ranks in place with a ring of exchanges."""
    for n in (2, 3):
        sizes = [n, 5 * n, 400 * n]
        launch_check(
            "03.1",
            _ring_worker,
            n,
            ring_all_reduce=ring_all_reduce,
            sizes=sizes,
            dtypes=(torch.float64, torch.float32),
            timeout=90,
        )
    passed("03.1", "equal to all_reduce on 2 and 3 ranks, with the ring's 2(n-1)/n N elements sent")


TORCH_DDP = (
    "that is torch's DistributedDataParallel (its Reducer does the bucketing and the overlap in "
    "C++); write the hooks and the all-reduces yourself, on top of BucketedNoOverlapDDP"
)


@contextlib.contextmanager
def _no_torch_ddp():
    """torch's DDP (a comm hook on it included) and its C++ Reducer refuse while the student's code
    runs: DDP's methods under every name, the Reducer's constructor (a C++ class) by patching."""
    from torch.nn.parallel import DistributedDataParallel

    def reducer(init):
        def refuse(self, *args, **kwargs):
            fail("03.2", TORCH_DDP)

        return refuse

    with (
        refuse_calls("03.2", [DistributedDataParallel], TORCH_DDP),
        patched_methods(dist.Reducer, {"__init__": reducer}),
    ):
        yield


class _ZeroGradientMLP(ToyMLP):
    """A layer that every rank uses with a weight of exactly zero: its gradient is zeros, not
    None, and one process's momentum and weight decay still move it."""

    def __init__(self):
        super().__init__()
        self.muted = nn.Linear(32, 32)

    def forward(self, x):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc3(h + 0.0 * self.muted(h))


def _overlap_worker(ctx, wrapper_cls, models, steps=3):
    """Every model in ``models`` ((make, rank_dependent) pairs), one after the other, in one
    launch: one start-up of the ranks for the whole check."""
    for make_model, rank_dependent in models:
        _overlap_model(ctx, wrapper_cls, make_model, rank_dependent, steps)
        dist.barrier()
    return True


def _overlap_model(ctx, wrapper_cls, make_model, rank_dependent, steps):
    n, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    reference = make_model().to(ctx.device, torch.float64)
    torch.manual_seed(0)
    inner = make_model().to(ctx.device, torch.float64)
    if rank_dependent:
        inner.rank = r
    with refuse_calls("03.2", [BucketedDDP], FINISHED), _no_torch_ddp():
        model = wrapper_cls(inner, bucket_cap_mb=0.002)  # a few KB: several buckets
    if isinstance(model, BucketedDDP):
        fail("03.2", FINISHED)
    buckets = getattr(model, "buckets", None)
    if not buckets:
        fail("03.2", "keep the buckets BucketedNoOverlapDDP builds (super().__init__) in "
             "self.buckets")  # fmt: skip
    log, phase = [], {"now": "forward"}

    def launching(real):
        def launched(group, tensors, *args, **kwargs):  # every c10d all-reduce ends here
            work = real(group, tensors, *args, **kwargs)
            many = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            log.append(("L", id(work), sum(t.numel() for t in many), phase["now"]))
            return work

        return launched

    def waiting(real):
        def waited(work, *args, **kwargs):  # dist.all_reduce without async_op waits here too
            log.append(("W", id(work), 0, phase["now"]))
            return real(work, *args, **kwargs)

        return waited

    functional = _FunctionalAllReduces(log, phase)
    for p in inner.parameters():  # after the student's hooks: backward went on past this gradient
        p.register_post_accumulate_grad_hook(lambda p: log.append(("G", 0, 0, phase["now"])))

    # momentum and weight decay: a zero gradient moves a parameter, no gradient does not
    opt = torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    data = torch.Generator().manual_seed(1)
    refusals = contextlib.ExitStack()
    refusals.enter_context(refuse_calls("03.2", [BucketedDDP], FINISHED))
    refusals.enter_context(_no_torch_ddp())
    refusals.enter_context(patched_methods(dist.ProcessGroup, {"allreduce": launching}))
    refusals.enter_context(patched_methods(dist.Work, {"wait": waiting}))
    refusals.enter_context(functional)
    try:
        for step in range(1, steps + 1):
            x = torch.randn(16, 16, generator=data, dtype=torch.float64).to(ctx.device)
            y = torch.randint(4, (16,), generator=data).to(ctx.device)
            opt_ref.zero_grad()
            for q in range(n):  # every rank's share of the global batch, each with its behaviour
                if rank_dependent:
                    reference.rank = q
                loss = nn.functional.cross_entropy(reference(x.chunk(n)[q]), y.chunk(n)[q])
                (loss / n).backward()
            opt_ref.step()
            opt.zero_grad()
            log.clear()
            loss = nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r])
            phase["now"] = "backward"
            loss.backward()
            phase["now"] = "finish"
            model.finish_gradient_synchronization()
            phase["now"] = "forward"
            _judge_overlap(log, buckets, make_model, r, step)
            _judge_grads(inner, reference, n, r, step)
            opt.step()
            _judge_params(inner, reference, r, step)
    finally:
        refusals.close()
    return True


class _FunctionalAllReduces(CommunicationMode):
    """All-reduces made with the functional collectives (funcol.all_reduce), logged as launches;
    their waits happen where the result is first used, which the check does not follow."""

    def __init__(self, log, phase):
        super().__init__()
        self.log, self.phase = log, phase

    def after(self, call, out) -> None:
        if call.namespace == "_c10d_functional" and "all_reduce" in call.name:
            first = call.args[0]
            numel = sum(t.numel() for t in (first if isinstance(first, list) else [first]))
            self.log.append(("F", id(out), numel, self.phase["now"]))


def _judge_overlap(log, buckets, make_model, r, step):
    launches = [e for e in log if e[0] in ("L", "F")]
    if not launches:
        fail("03.2", f"rank {r}, step {step}: no all-reduce ran at all"
             + (": is what your hooks count reset for the next step?" if step > 1 else ""))  # fmt: skip
    n_params = sum(len(b) for b in buckets)
    grads = [sum(p.numel() for p in b) for b in buckets]
    flags = [len(b) for b in buckets]
    sizes = [e[2] for e in launches]
    if n_params in sizes and n_params not in grads:
        sizes.remove(n_params)  # one map of the parameters each rank used, as torch's DDP sends
    sizes = [s for s in sizes if s not in flags or s in grads]  # flags sent apart
    allowed = [{g, g + f} for g, f in zip(grads, flags)]
    if len(sizes) != len(buckets) or any(s not in ok for s, ok in zip(sizes, allowed)):
        fail("03.2", f"rank {r}, step {step}: your all-reduces carried {sizes} elements; the "
             f"buckets, in bucket order, hold {grads} gradient elements (plus one flag per "
             "parameter if you send them along): one all-reduce per bucket, launched in bucket "
             "order on every rank (collectives are matched by the order of the calls)")  # fmt: skip
    # overlap, from the work handles: a bucket's all-reduce launched during backward must not be
    # waited on before backward has gone on (a gradient accumulated after it, or backward ended)
    for k, (kind, key, numel, when) in enumerate(log):
        if kind != "L" or when != "backward":
            continue
        later = log[k + 1 :]
        wait = next((i for i, e in enumerate(later) if e[0] == "W" and e[1] == key), None)
        if wait is None:
            continue  # never waited: its gradient would be judged wrong below
        between = later[:wait]
        if not any(e[0] == "G" for e in between) and later[wait][3] == "backward":
            fail("03.2", f"rank {r}, step {step}: an all-reduce of {numel} elements was waited on "
                 "as soon as it was launched, inside backward (a .wait() in the hook, or "
                 "dist.all_reduce without async_op=True), so backward stood still while it ran: "
                 "keep the handle, let backward go on, and wait in finish_gradient_"
                 "synchronization")  # fmt: skip
    during = sum(1 for e in launches if e[3] == "backward")
    if make_model is ToyMLP and during < len(buckets):
        fail("03.2", f"rank {r}, step {step}: {during} of {len(buckets)} buckets started during "
             "backward with this model, whose every parameter gets a gradient: launch a bucket "
             "from a gradient hook (register_post_accumulate_grad_hook) as soon as its last "
             "gradient is ready, not in finish_gradient_synchronization")  # fmt: skip


def _judge_grads(inner, reference, n, r, step):
    for (name, p), q in zip(inner.named_parameters(), reference.parameters()):
        if p.grad is None or q.grad is None or torch.allclose(p.grad, q.grad, 1e-9, 1e-12):
            continue  # a missing gradient is judged on the parameters below
        if torch.allclose(p.grad, n * q.grad, 1e-9, 1e-12):
            fail("03.2", f"after step {step}, rank {r}'s gradient of {name} is {n} times one "
                 f"process's: divide the all-reduced sum by the {n} ranks (each rank's loss is a "
                 "mean over its own shard)")  # fmt: skip


def _judge_params(inner, reference, r, step):
    for (name, p), q in zip(inner.named_parameters(), reference.parameters()):
        diff = (p - q).abs().max().item()
        if diff <= 1e-12:
            continue
        if q.grad is not None and p.grad is None and not q.grad.any():
            hint = (
                "every rank used it and its gradient is exactly zero, so one process keeps a .grad "
                "of zeros (momentum and weight decay still move it); a sum of zero does not mean "
                "unused: decide by the flags, 1 where a rank has a gradient"
            )
        elif q.grad is None and p.grad is not None:
            hint = (
                "no rank used it, so one process leaves its .grad None; a zero gradient "
                "still moves it under momentum and weight decay. Send one flag per parameter "
                "(1 where this rank has a gradient) and leave .grad None where the sum is 0"
            )
        else:
            hint = (
                "a bucket that holds a parameter without a gradient never completes, so "
                "its hook never launches it (nor any bucket after it): launch every bucket "
                "still waiting in finish_gradient_synchronization, in bucket order, with "
                "zeros for the missing gradients"
            )
        fail("03.2", f"after step {step}, rank {r}'s {name} differs from one process by "
             f"{diff:.1e} ({type(inner).__name__}): {hint}.")  # fmt: skip


FINISHED = (
    "that is the package's BucketedDDP, the finished version the check compares with; write the "
    "hooks and the synchronisation yourself, on top of BucketedNoOverlapDDP."
)


def check_overlapped_ddp(wrapper_cls, world_size: int = 2) -> None:
    """Exercise 03.2: bucketed DDP whose all-reduces start during backward, one per bucket in
    bucket order, equal to one process, parameters unused in forward included."""
    models = [(ToyMLP, False), (TiedMLP, False), (UnusedParamMLP, False), (RankDependentMLP, True),
              (_ZeroGradientMLP, False)]  # fmt: skip
    launch_check("03.2", _overlap_worker, world_size, wrapper_cls=wrapper_cls, models=models,
                 timeout=120)  # fmt: skip
    passed(
        "03.2",
        f"equal to one process on {world_size} ranks, every bucket started during backward in "
        "bucket order and not waited on there; a layer no rank uses, one only odd ranks use, one "
        "used twice, and one whose gradient is exactly zero",
    )
