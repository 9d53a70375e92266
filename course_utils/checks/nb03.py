"""Checks for notebook 03 (DDP): ring all-reduce from point-to-point, and unused parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import BucketedDDP
from ..models import RankDependentMLP, UnusedParamMLP
from .common import ExerciseError, fail, launch_check, passed


def _ring_worker(ctx, ring_all_reduce, sizes, dtypes):
    n, r = ctx.world_size, ctx.rank
    sent = {"elements": 0}
    send = dist.ProcessGroup.send

    def counting_send(group, tensors, dst, tag=0):  # every point-to-point send goes through here
        sent["elements"] += sum(t.numel() for t in tensors)
        return send(group, tensors, dst, tag)

    dist.ProcessGroup.send = counting_send
    try:
        for numel in sizes:
            for dtype in dtypes:
                g = torch.Generator().manual_seed(1000 * r + numel)
                t = torch.randn(numel, generator=g, dtype=dtype).to(ctx.device)
                before = t.clone()
                ref = t.clone()
                dist.all_reduce(ref)
                sent["elements"] = 0
                ring_all_reduce(t)
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
    finally:
        dist.ProcessGroup.send = send
    return True


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


def _unused_worker(ctx, wrapper_cls, make_model, rank_dependent, steps=3):
    n, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    reference = make_model().to(ctx.device, torch.float64)
    torch.manual_seed(0)
    inner = make_model().to(ctx.device, torch.float64)
    if rank_dependent:
        inner.rank = r
    model = wrapper_cls(inner, bucket_cap_mb=0.002)
    if isinstance(model, BucketedDDP):
        raise ExerciseError(f"exercise 03.2: {FINISHED}")
    # momentum and weight decay: a zero gradient moves a parameter, no gradient does not
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    data = torch.Generator().manual_seed(1)
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
        nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r]).backward()
        model.finish_gradient_synchronization()
        for (name, p), q in zip(inner.named_parameters(), reference.parameters()):
            if p.grad is None or q.grad is None or torch.allclose(p.grad, q.grad, 1e-9, 1e-12):
                continue  # a missing gradient is judged on the parameters below
            if torch.allclose(p.grad, n * q.grad, 1e-9, 1e-12):
                raise ExerciseError(
                    f"exercise 03.2: after step {step}, rank {r}'s gradient of {name} is {n} times "
                    f"one process's ({type(inner).__name__}): did you divide by world_size? The "
                    f"all-reduce sums over the {n} ranks, and each rank's loss is already a mean "
                    "over its own shard."
                )
        opt.step()
        for (name, p), q in zip(inner.named_parameters(), reference.parameters()):
            diff = (p - q).abs().max().item()
            if diff > 1e-12:
                if q.grad is None and p.grad is not None:
                    hint = (
                        "no rank used it, so one process leaves its .grad None; a zero gradient "
                        "still moves it under momentum and weight decay. Use the per-parameter "
                        "counts to leave .grad None where no rank had one"
                    )
                else:
                    hint = (
                        "a bucket that holds a parameter without a gradient never completes, so "
                        "its hook never launches it (nor any bucket after it): launch every bucket "
                        "still waiting in finish_gradient_synchronization, in bucket order, with "
                        "zeros for the missing gradients"
                    )
                raise ExerciseError(
                    f"exercise 03.2: after step {step}, rank {r}'s {name} differs from one process "
                    f"by {diff:.1e} ({type(inner).__name__}): {hint}."
                )
    return True


FINISHED = (
    "that is the package's BucketedDDP, the finished version the check compares with; write the "
    "unused-parameter handling yourself, on top of OverlappedDDP."
)


def check_ddp_unused_parameters(wrapper_cls, world_size: int = 2) -> None:
    """Exercise 03.2: a from-scratch DDP class that survives parameters unused in forward."""
    if isinstance(wrapper_cls, type) and issubclass(wrapper_cls, BucketedDDP):
        fail("03.2", FINISHED)  # a factory that returns one is caught in the ranks
    for make, rank_dependent in ((UnusedParamMLP, False), (RankDependentMLP, True)):
        launch_check(
            "03.2",
            _unused_worker,
            world_size,
            wrapper_cls=wrapper_cls,
            make_model=make,
            rank_dependent=rank_dependent,
            timeout=90,
        )
    passed(
        "03.2",
        f"equal to one process on {world_size} ranks with a layer no rank uses and one that only "
        "odd ranks use",
    )
