"""Checks for notebook 08 (ZeRO): the padded shard of a flat buffer, and stage 1's step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models import ToyMLP
from ..tensor_parallel.measure import CollectiveCounter
from ..zero import flat as zero_flat
from .common import ExerciseError, fail, launch_check, passed, refused


def _bounds(numel: int, n: int, rank: int) -> tuple[int, int, int]:
    shard = -(-numel // n)
    return rank * shard, (rank + 1) * shard, shard * n - numel


def check_shard_bounds(shard_bounds) -> None:
    """Exercise 08.1: ``shard_bounds(numel, n, rank) -> (start, end, padding)``."""
    cases = [(10, 4, 0), (10, 4, 3), (12, 4, 2), (3, 8, 5), (3, 8, 0), (1, 1, 0), (1732, 3, 2),
             (7, 7, 6), (1000003, 16, 15)]  # fmt: skip
    with refused("08.1", shard_bounds, zero_flat.padded_numel,
                 "write the arithmetic yourself, without course_utils.zero.flat"):  # fmt: skip
        for numel, n, rank in cases:
            want = _bounds(numel, n, rank)
            got = shard_bounds(numel, n, rank)
            if not (isinstance(got, tuple | list) and len(got) == 3):
                fail("08.1", f"return (start, end, padding); got {got!r}")
            got = tuple(int(x) for x in got)
            if got == want:
                continue
            start, end, pad = got
            where = f"for {numel} elements on {n} ranks, rank {rank}"
            if end - start != want[1] - want[0]:
                hint = (
                    f"its shard has {end - start} elements; every rank must hold the same number, "
                    "enough that n of them cover all the elements (round up)"
                )
            elif pad != want[2]:
                hint = (
                    f"padding {pad}: the padded buffer is n shards long, and holds numel elements"
                )
            else:
                hint = "rank r's shard is the r-th of n equal pieces of the padded buffer"
            fail("08.1", f"{where}: got (start, end, padding) = {got}; {hint}.")
    passed("08.1", f"right on {len(cases)} cases, including fewer elements than ranks")


def _stage1_worker(ctx, zero1_step, steps: int = 3):
    n, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    reference = ToyMLP().to(ctx.device, torch.float64)
    torch.manual_seed(0)
    model = ToyMLP().to(ctx.device, torch.float64)
    params = list(model.parameters())
    bucket = zero_flat.Bucket.of(params, n)
    flat_params = bucket.flatten([p.detach() for p in params])
    for p, view in zip(params, bucket.views(flat_params)):
        p.data = view
    lo, hi = bucket.shard_range(r)
    shard = nn.Parameter(flat_params[lo:hi])
    opt = torch.optim.SGD([shard], lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        x = torch.randn(8 * n, 16, generator=data, dtype=torch.float64).to(ctx.device)
        y = torch.randint(4, (8 * n,), generator=data).to(ctx.device)
        before = [p.detach().clone() for p in reference.parameters()]
        opt_ref.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt_ref.step()
        for p in params:
            p.grad = None
        nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r]).backward()  # own data
        flat_grads = bucket.flatten([p.grad for p in params])
        with CollectiveCounter() as comm:
            zero1_step(flat_params, flat_grads, shard, opt)
        counts = dict(comm.counts)
        where = f"on {n} ranks, step {step}"
        if counts.get("all_reduce"):
            fail("08.2", f"{where}, rank {r} all-reduced the gradients: every rank then receives all "
                 "of them (2Ψ), and the all-gather adds Ψ more. Reduce-scatter sends each rank "
                 "only its shard: 2Ψ in all")  # fmt: skip
        if counts.get("reduce_scatter", 0) != 1:
            fail("08.2", f"{where}, rank {r} called {counts or 'no collective'}: reduce-scatter the "
                 "flat gradients once (dist.reduce_scatter_tensor)")  # fmt: skip
        if counts.get("all_gather", 0) != 1:
            fail("08.2", f"{where}, rank {r} called {counts}: after the step the other ranks' shards "
                 "are stale; all-gather every rank's shard into flat_params once")  # fmt: skip
        err = max((p - q).abs().max().item() for p, q in zip(params, reference.parameters()))
        if err > 1e-12:
            moved = sum((p - b).abs().sum().item() for p, b in zip(params, before))
            want = sum((q - b).abs().sum().item() for q, b in zip(reference.parameters(), before))
            if step == 1 and moved == 0:
                hint = "no parameter moved: put your gradient shard in shard.grad and step the optimizer"
            elif step == 1 and abs(moved / want - n) < 1e-6:
                hint = f"the update is {n}× too large: did you divide by n (the mean, not the sum)?"
            else:
                hint = ("rank r's shard is flat[r·S:(r+1)·S], S = len(flat) / n: the reduce-scatter's "
                        "output, divided by n, is its gradient")  # fmt: skip
            fail(
                "08.2",
                f"{where}, rank {r}'s parameters differ from one process by {err:.2g}: {hint}",
            )
    dist.barrier()
    return True


def check_zero1_step(zero1_step) -> None:
    """Exercise 08.2: ``zero1_step(flat_params, flat_grads, shard, optimizer)`` on every rank."""
    from ..zero import stage1

    with refused("08.2", zero1_step, stage1.reduce_scatter_mean,
                 "write the collectives yourself, without course_utils.zero"):  # fmt: skip
        for n in (2, 3):  # 3 ranks: 1732 parameters do not split evenly, the buffer is padded
            launch_check("08.2", _stage1_worker, n, zero1_step=zero1_step, timeout=90)
    passed("08.2", "equal to one process on 2 and 3 ranks (different data per rank), with one "
           "reduce-scatter and one all-gather per step")  # fmt: skip


__all__ = ["ExerciseError", "check_shard_bounds", "check_zero1_step"]
