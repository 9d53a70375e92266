"""Checks for notebook 08 (ZeRO): the padded shard of a flat buffer, stage 1's step, and stage 3's
gathers, frees and reduce-scatters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..measure import max_abs_diff
from ..measure import worst as worst_of
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
        err = max_abs_diff(zip(params, reference.parameters()))
        if not err <= 1e-12:  # a NaN fails too
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


# ---- 08.3 stage 3: gather before use, free after, reduce-scatter after backward ----------------

PACKAGE_STAGE3 = (
    "that is the package's own stage 3 (course_utils.zero.ShardedModel) or torch's FSDP, which "
    "the check compares with: write the gathers, frees and reduce-scatters yourself"
)


def _held_bytes(model) -> int:
    """Bytes of trainable parameters that hold their full data right now."""
    total = 0
    for p in model.parameters():
        if p.requires_grad and p.numel() and p.untyped_storage().nbytes():
            total += p.numel() * p.element_size()
    return total


def _no_fsdp():
    import contextlib

    from torch.distributed import fsdp

    @contextlib.contextmanager
    def guard():
        saved = fsdp.fully_shard, fsdp.FullyShardedDataParallel.__init__

        def refuse(*args, **kwargs):
            fail("08.3", PACKAGE_STAGE3)

        fsdp.fully_shard, fsdp.FullyShardedDataParallel.__init__ = refuse, refuse
        try:
            yield
        finally:
            fsdp.fully_shard, fsdp.FullyShardedDataParallel.__init__ = saved

    return guard()


def _stage3_worker(ctx, zero3_cls):
    import contextlib

    from ..zero import run as zero_run
    from ..zero import stage3
    from .common import refuse_calls

    n, r = ctx.world_size, ctx.rank
    guard = contextlib.ExitStack()
    guard.enter_context(refuse_calls("08.3", [stage3.ShardedModel, stage3.Unit], PACKAGE_STAGE3))
    guard.enter_context(_no_fsdp())
    with guard:
        # memory and bytes, on the MLP: one unit gathered at a time, 3Ψ per step
        torch.manual_seed(0)
        model = ToyMLP().to(ctx.device, torch.float64)
        units = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
        unit_bytes = [sum(p.numel() * 8 for p in m.parameters(recurse=False)) for m in units]
        z = zero3_cls(model, torch.optim.SGD, {"lr": 0.1})
        peak = [0]

        def probe(*_):
            peak[0] = max(peak[0], _held_bytes(model))

        def probe_in_backward(module, args, out):  # runs when the output's gradient arrives
            if out.requires_grad:
                out.register_hook(lambda grad: probe())

        for m in units:  # registered after the student's hooks: they run after them
            m.register_forward_pre_hook(lambda *a: probe())
            m.register_forward_hook(probe_in_backward)
        if _held_bytes(model):
            fail("08.3", f"rank {r} holds {_held_bytes(model):,} bytes of full parameters right "
                 "after building the class: between uses a rank keeps its shards only")  # fmt: skip
        x = torch.randn(8, 16, dtype=torch.float64, device=ctx.device)
        y = torch.randint(4, (8,), device=ctx.device)
        with CollectiveCounter() as comm:
            nn.functional.cross_entropy(model(x), y).backward()
            z.step()
        slack = 8 * n * len(units)  # padding
        if peak[0] > max(unit_bytes) + slack:
            fail("08.3", f"rank {r} held {peak[0]:,} bytes of full parameters at once, more than "
                 f"the largest unit ({max(unit_bytes):,}): free each unit right after its forward, "
                 "and after its backward")  # fmt: skip
        if _held_bytes(model):
            fail("08.3", f"after the step rank {r} still holds {_held_bytes(model):,} bytes of "
                 "full parameters: free each unit once its gradients are reduce-scattered")  # fmt: skip
        psi_bytes = sum(unit_bytes)
        got = {k: comm.bytes.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}
        if got["all_reduce"]:
            fail("08.3", "stage 3 needs no all-reduce: reduce-scatter each unit's gradients")
        if not psi_bytes <= got["reduce_scatter"] <= psi_bytes + slack:
            fail("08.3", f"rank {r} reduce-scattered {got['reduce_scatter']:,} bytes in a step; each "
                 f"unit's gradients once ({psi_bytes:,} bytes, Ψ, plus padding)")  # fmt: skip
        if not 2 * psi_bytes <= got["all_gather"] <= 2 * (psi_bytes + slack):
            fail("08.3", f"rank {r} all-gathered {got['all_gather']:,} bytes in a step; each unit "
                 f"once before its forward and once before its backward ({2 * psi_bytes:,}, 2Ψ)")  # fmt: skip
        for model_name, opt in (("mlp", "adam"), ("tied", "adam"), ("frozen", "sgd")):
            built = []

            def method(model, optimizer_class, options, built=built):
                z = zero3_cls(model, optimizer_class, options)
                built.append(model)
                return model, z, z.full_parameters

            out = zero_run.parity_worker(ctx, method, model=model_name, optimizer=opt, steps=3,
                                         global_batch=12 * n)  # fmt: skip
            worst = worst_of(out["diffs"])  # NaN if any is NaN
            if not worst < 1e-12:
                if _held_bytes(built[0]):
                    hint = ("units were still gathered after the step, so the next forward found "
                            "them present and ran on stale parameters: free each unit after its "
                            "forward and after its backward")  # fmt: skip
                else:
                    hint = ("each unit's gradient shard is the reduce-scatter of its full "
                            "gradients, divided by n; the optimizer steps the shards")  # fmt: skip
                fail("08.3", f"{model_name} model, {opt}, {n} ranks: rank {r}'s parameters differ "
                     f"from one process by {worst:.2g} after 3 steps: {hint}")  # fmt: skip
    dist.barrier()
    return True


def check_zero3(zero3_cls) -> None:
    """Exercise 08.3: a ``Zero3(model, optimizer_class, options)`` whose units are gathered before
    their forward and their backward, freed after each, and whose gradients are reduce-scattered
    after their backward: equal to one process (tied and frozen layers included), one unit held
    at a time, 3Ψ per step."""
    from ..zero import stage3
    from .common import refuse_copies

    refuse_copies("08.3", zero3_cls, (stage3.ShardedModel, stage3.Unit), PACKAGE_STAGE3)
    for n in (2, 3):
        launch_check("08.3", _stage3_worker, n, zero3_cls=zero3_cls, timeout=120)
    passed("08.3", "equal to one process on 2 and 3 ranks (tied and frozen layers), one unit "
           "gathered at a time, Ψ reduce-scattered and 2Ψ all-gathered per step")  # fmt: skip


__all__ = ["ExerciseError", "check_shard_bounds", "check_zero1_step", "check_zero3"]
