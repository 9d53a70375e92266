"""Checks for notebook 03 (DDP): ring all-reduce from point-to-point, and bucketed DDP overlapped
with backward (unused parameters included)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import BucketedDDP
from ..models import RankDependentMLP, TiedMLP, ToyMLP, UnusedParamMLP
from .common import (
    ExerciseError,
    OnlyCommunication,
    fail,
    launch_check,
    passed,
    patched_methods,
    refuse_calls,
    refuse_copies,
)


def _ring_worker(ctx, ring_all_reduce, sizes, dtypes):
    n, r = ctx.world_size, ctx.rank
    sent = {"elements": 0, "elsewhere": None}

    def counting(send):
        def counting_send(group, tensors, dst, tag=0):  # every point-to-point send ends here
            sent["elements"] += sum(t.numel() for t in tensors)
            if dst != (r + 1) % n and sent["elsewhere"] is None:
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
                with OnlyCommunication("03.1", ("send", "recv_"), NOT_A_RING):
                    ring_all_reduce(t)
                if sent["elsewhere"] is not None:
                    fail("03.1", f"rank {r} sent to rank {sent['elsewhere']}: in a ring every "
                         f"rank sends only to its right neighbour, rank {(r + 1) % n}")  # fmt: skip
                where = f"{n} ranks, {numel} elements, {str(dtype).replace('torch.', '')}"
                tol = 1e-12 if dtype == torch.float64 else 1e-4
                if not torch.allclose(t, ref, rtol=tol, atol=tol):
                    chunks_ok = [
                        torch.allclose(a, b, rtol=tol, atol=tol)
                        for a, b in zip(t.chunk(n), ref.chunk(n))
                    ]
                    if torch.equal(t, before):
                        hint = "t did not change: the ring works on t's chunks, in place"
                    elif any(chunks_ok):
                        hint = (
                            f"{sum(chunks_ok)} of {n} chunks are right: after the reduce-scatter each "
                            "rank owns one fully summed chunk, and the all-gather must carry every "
                            "chunk around the ring"
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
    """torch's DDP (and with it a comm hook on it) refuses to be built while the student's code runs."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__

    def refuse(self, *args, **kwargs):
        fail("03.2", TORCH_DDP)

    DistributedDataParallel.__init__ = refuse
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = init


def _overlap_worker(ctx, wrapper_cls, make_model, rank_dependent, steps=3):
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

    def watching(real):
        def watched(group, tensors, *args, **kwargs):
            # every all-reduce ends here, however it was called; dist.all_reduce waits at once
            # unless its caller passed async_op=True (group.allreduce itself returns a handle)
            caller = sys._getframe(1).f_locals
            asynchronous = bool(caller.get("async_op", True))
            many = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            log.append((phase["now"], sum(t.numel() for t in many), asynchronous))
            return real(group, tensors, *args, **kwargs)

        return watched

    # momentum and weight decay: a zero gradient moves a parameter, no gradient does not
    opt = torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    data = torch.Generator().manual_seed(1)
    refusals = contextlib.ExitStack()
    refusals.enter_context(refuse_calls("03.2", [BucketedDDP], FINISHED))
    refusals.enter_context(_no_torch_ddp())
    refusals.enter_context(patched_methods(dist.ProcessGroup, {"allreduce": watching}))
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


def _judge_overlap(log, buckets, make_model, r, step):
    if not log:
        fail("03.2", f"rank {r}, step {step}: no all-reduce ran at all")
    sync = [c for c in log if not c[2]]
    if sync:
        fail("03.2", f"rank {r}, step {step}: an all-reduce ran with async_op=False during "
             f"{sync[0][0]}: start each bucket's all-reduce with async_op=True and wait for its "
             "handle in finish_gradient_synchronization, so that backward goes on meanwhile")  # fmt: skip
    grads = [sum(p.numel() for p in b) for b in buckets]
    flags = [len(b) for b in buckets]
    sizes = [numel for _, numel, _ in log if numel not in flags or numel in grads]
    allowed = [{g, g + f} for g, f in zip(grads, flags)]
    if len(sizes) != len(buckets) or any(s not in ok for s, ok in zip(sizes, allowed)):
        fail("03.2", f"rank {r}, step {step}: your all-reduces carried {sizes} elements; the "
             f"buckets, in bucket order, hold {grads} gradient elements (plus one flag per "
             "parameter if you send them along): one all-reduce per bucket, launched in bucket "
             "order on every rank (collectives are matched by the order of the calls)")  # fmt: skip
    during = sum(1 for ph, _, _ in log if ph == "backward")
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
        if q.grad is None and p.grad is not None:
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
    refuse_copies("03.2", wrapper_cls, [BucketedDDP], FINISHED)
    for make, rank_dependent in (
        (ToyMLP, False),
        (TiedMLP, False),
        (UnusedParamMLP, False),
        (RankDependentMLP, True),
    ):
        launch_check(
            "03.2",
            _overlap_worker,
            world_size,
            wrapper_cls=wrapper_cls,
            make_model=make,
            rank_dependent=rank_dependent,
            timeout=90,
        )
    passed(
        "03.2",
        f"equal to one process on {world_size} ranks, every bucket started during backward in "
        "bucket order; a layer no rank uses, one only odd ranks use, and a layer used twice",
    )
