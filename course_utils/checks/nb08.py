"""Checks for notebook 08 (ZeRO): the padded shard of a flat buffer, stage 1's step, and stage 3's
gathers, frees and reduce-scatters."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CollectiveCounter
from ..measure import max_abs_diff
from ..measure import worst as worst_of
from ..models import ToyMLP
from ..zero import flat as zero_flat
from ..zero import parity as zero_run
from ..zero import stage1, stage3
from .common import ExerciseError, fail, launch_check, no_store, passed, refuse_calls


def _bounds(numel: int, n: int, rank: int) -> tuple[int, int, int]:
    shard = -(-numel // n)
    return rank * shard, (rank + 1) * shard, shard * n - numel


def check_shard_bounds(shard_bounds) -> None:
    """Exercise 08.1: ``shard_bounds(numel, n, rank) -> (start, end, padding)``."""
    cases = [(10, 4, 0), (10, 4, 3), (12, 4, 2), (3, 8, 5), (3, 8, 0), (1, 1, 0), (1732, 3, 2),
             (7, 7, 6), (1000003, 16, 15)]  # fmt: skip
    wants = [_bounds(numel, n, rank) for numel, n, rank in cases]
    for (numel, n, rank), want in zip(cases, wants):
        with refuse_calls("08.1", [zero_flat.padded_numel, _bounds],
                          "write the arithmetic yourself, without course_utils.zero.flat"):  # fmt: skip
            got = shard_bounds(numel, n, rank)
        if not (isinstance(got, tuple | list) and len(got) == 3):
            fail("08.1", f"return (start, end, padding); got {got!r}")
        got = tuple(int(x) for x in got)
        if got == want:
            continue
        start, end, pad = got
        where = f"for {numel} elements on {n} ranks, rank {rank}"
        size = end - start
        elements = f"{size} element{'s' if size != 1 else ''}"
        if size > want[1] - want[0]:
            hint = (
                f"its shard has {elements}, more than needed: the shard is the smallest size "
                "that n ranks can cover all the elements with, so the padding is less than n"
            )
        elif size != want[1] - want[0]:
            hint = (
                f"its shard has {elements}; every rank must hold the same number, "
                "enough that n of them cover all the elements (round up)"
            )
        elif pad != want[2]:
            hint = f"padding {pad}: the padded buffer is n shards long, and holds numel elements"
        else:
            hint = "rank r's shard is the r-th of n equal pieces of the padded buffer"
        fail("08.1", f"{where}: got (start, end, padding) = {got}; {hint}.")
    passed("08.1", f"right on {len(cases)} cases, including fewer elements than ranks")


PACKAGE_STAGE1 = "write the collectives yourself, without course_utils.zero"


def _stage1_models(ctx):
    """The reference model, and the same model (seed 0) whose parameters are views into one flat
    buffer padded to n shards; this rank's shard is a Parameter over its slice of it."""
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
    return reference, model, params, bucket, flat_params, shard


def _judge_stage1_traffic(where, r, opt, shard, counts, sent, params, flat_grads) -> None:
    """The optimizer stepped this rank's shard, and each gradient was reduced once and each updated
    shard sent once (Ψ bytes each, plus padding), with no all-reduce."""
    if not opt.state.get(shard):
        fail("08.2", f"{where}, rank {r} did not step the optimizer it was given, which holds "
             "this rank's shard and its state (1/n of a full optimizer's): put the shard's "
             "gradient in shard.grad and call optimizer.step()")  # fmt: skip
    psi = sum(p.numel() for p in params) * 8  # the gradients' bytes, unpadded
    padded = flat_grads.numel() * 8
    if counts.get("all_reduce"):
        fail("08.2", f"{where}, rank {r} all-reduced the gradients: every rank then receives all "
             "of them, though it updates only its shard. Reduce-scatter them (each rank gets "
             "the sum of its own shard), or reduce each shard to its owner")  # fmt: skip
    reduced = sent.get("reduce_scatter", 0) + sent.get("reduce", 0)
    if not psi <= reduced <= padded:
        fail("08.2", f"{where}, rank {r} handed {reduced:,} bytes of gradients to "
             f"reduce-scatter/reduce ({counts or 'no collective'}): stage 1 reduces each "
             f"gradient once, {psi:,} bytes (Ψ, plus padding), so that each rank gets the sum "
             "of its own shard")  # fmt: skip
    spread = sent.get("all_gather", 0) + sent.get("broadcast", 0)
    if not psi <= spread <= padded:
        fail("08.2", f"{where}, rank {r} gathered or broadcast {spread:,} bytes "
             f"({counts or 'no collective'}): after the step the other ranks' shards are "
             f"stale; every rank's updated shard must reach every rank once, {psi:,} bytes "
             "(Ψ, plus padding) in all: all-gather them into flat_params")  # fmt: skip


def _judge_stage1_params(where, r, n, step, params, reference, before, stale) -> None:
    """This rank's parameters equal one process's; when not, a hint from how far they moved."""
    err = max_abs_diff(zip(params, reference.parameters()))
    if not err <= 1e-12:  # a NaN fails too
        moved = sum((p - b).abs().sum().item() for p, b in zip(params, before))
        want = sum((q - b).abs().sum().item() for q, b in zip(reference.parameters(), before))
        if step == 1 and moved == 0:
            hint = (
                "no parameter moved: put your gradient shard in shard.grad and step the optimizer"
            )
        elif step == 1 and abs(moved / want - n) < 1e-6:
            hint = f"the update is {n}× too large: did you divide by n (the mean, not the sum)?"
        elif stale:
            hint = ("after your call flat_params holds other ranks' shards that differ from "
                    "those shards after the step: all-gather the shards after "
                    "optimizer.step(), so that every rank receives the updated ones")  # fmt: skip
        else:
            hint = ("rank r's shard is flat[r·S:(r+1)·S], S = len(flat) / n: the reduce-scatter's "
                    "output, divided by n, is its gradient")  # fmt: skip
        fail(
            "08.2",
            f"{where}, rank {r}'s parameters differ from one process by {err:.2g}: {hint}",
        )


def _stage1_worker(ctx, zero1_step, steps: int = 3):
    """One rank of check 08.2: ``steps`` steps of ``zero1_step`` on its own data, each against one
    process on the global batch, with its collectives counted."""

    n, r = ctx.world_size, ctx.rank
    reference, model, params, bucket, flat_params, shard = _stage1_models(ctx)
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
        with (
            CollectiveCounter() as comm,
            refuse_calls("08.2", [stage1.reduce_scatter_mean], PACKAGE_STAGE1),
            no_store("08.2"),
        ):
            zero1_step(flat_params, flat_grads, shard, opt)
        counts, sent = dict(comm.counts), dict(comm.bytes)
        where = f"on {n} ranks, step {step}"
        fresh = torch.empty_like(flat_params)  # every rank's shard as it is now, after the step
        dist.all_gather_into_tensor(fresh, shard.detach())
        stale = not torch.equal(fresh, flat_params)
        _judge_stage1_traffic(where, r, opt, shard, counts, sent, params, flat_grads)
        _judge_stage1_params(where, r, n, step, params, reference, before, stale)
    dist.barrier()
    return True


def check_zero1_step(zero1_step) -> None:
    """Exercise 08.2: ``zero1_step(flat_params, flat_grads, shard, optimizer)`` on every rank."""
    for n in (2, 3):  # 3 ranks: 1732 parameters do not split evenly, the buffer is padded
        launch_check("08.2", _stage1_worker, n, zero1_step=zero1_step, timeout=90)
    passed("08.2", "equal to one process on 2 and 3 ranks (different data per rank), with each "
           "gradient reduced once and each updated shard sent once (Ψ each, plus padding)")  # fmt: skip


# ---- 08.3 stage 3: gather before use, free after, reduce-scatter after backward ----------------

FSDP = (
    "that is torch's FSDP (fully_shard or FullyShardedDataParallel), which does stage 3 for you: "
    "write the gathers, frees and reduce-scatters yourself"
)
PACKAGE_STAGE3 = (
    "that is the package's own stage 3 (course_utils.zero.ShardedModel) or torch's FSDP, which "
    "the check compares with: write the gathers, frees and reduce-scatters yourself"
)


def _held_bytes(model, z=None) -> int:
    """Bytes of full parameters held right now: the storages of the model's trainable parameters
    and of the units' flat buffers (``z.units[i]["flat"]``), each storage once, whatever the
    parameters point to (a parameter re-pointed at an empty tensor frees nothing if its buffer
    still holds the bytes)."""
    storages = {}
    tensors = [p for p in model.parameters() if p.requires_grad]
    for u in getattr(z, "units", None) or []:
        if isinstance(u, dict) and isinstance(u.get("flat"), torch.Tensor):
            tensors.append(u["flat"])
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _gradient_units(units) -> int:
    """How many units hold full gradients (a .grad on any of their parameters) right now."""
    return sum(1 for m in units if any(p.grad is not None for p in m.parameters(recurse=False)))


def _no_fsdp():
    from torch.distributed import fsdp

    return refuse_calls("08.3", [fsdp.fully_shard, fsdp.FullyShardedDataParallel], FSDP)


class _Stage3Errors:
    """Turns the two torch errors a stage 3 typically runs into into what the student should do;
    any other error passes through unchanged."""

    def __init__(self, rank):
        self.rank = rank

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is None or not issubclass(kind, RuntimeError):
            return False
        text = str(error).splitlines()[0] if str(error) else kind.__name__
        if "out of bounds for storage of size 0" in text:
            fail("08.3", f"rank {self.rank}: a parameter was read while its unit was freed "
                 f"({text[:90]}...): a layer's backward reads its weights, so gather the unit "
                 "again before its backward (for example from a hook on its forward's output), "
                 "and free it after")  # fmt: skip
        if "sizes" in text or ("size" in text and "world" in text):
            fail("08.3", f"rank {self.rank}: a collective refused its tensors' sizes ({text[:120]}"
                 "): a reduce-scatter's input holds n shards, so pad each unit's flat gradients to "
                 "n × the shard's length, as the unit's parameters are (the Bucket's padding)")  # fmt: skip
        return False


def _stage3_guard(r) -> contextlib.ExitStack:
    """The package's stage 3 and torch's FSDP refused, and the two typical torch errors
    translated into hints (that one exits first: it sees the student's errors raw)."""

    guard = contextlib.ExitStack()
    guard.enter_context(refuse_calls("08.3", [stage3.ShardedModel, stage3.Unit], PACKAGE_STAGE3))
    guard.enter_context(_no_fsdp())
    guard.enter_context(_Stage3Errors(r))  # exits first: sees the student's errors raw
    return guard


def _watch_peaks(model, z, units) -> tuple[list[int], list[int]]:
    """Hooks on every unit that record the most bytes of full parameters held at once (before each
    forward and each backward) and the most units holding full gradients during backward."""
    peak, grad_peak = [0], [0]

    def probe(*_):
        peak[0] = max(peak[0], _held_bytes(model, z))

    def probe_in_backward(module, args, out):  # runs when the output's gradient arrives
        if out.requires_grad:
            out.register_hook(lambda grad: (probe(), grad_probe(), None)[-1])

    def grad_probe():  # before this unit's backward: earlier units' gradients are shards now
        grad_peak[0] = max(grad_peak[0], _gradient_units(units))

    for m in units:  # registered after the student's hooks: they run after them
        m.register_forward_pre_hook(lambda *a: probe())
        m.register_forward_hook(probe_in_backward)
    return peak, grad_peak


def _judge_stage3_bytes(r, comm, unit_bytes, slack) -> None:
    """One step's traffic: no all-reduce, Ψ reduce-scattered and 2Ψ all-gathered (plus padding)."""
    psi_bytes = sum(unit_bytes)
    got = {k: comm.bytes.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    if got["all_reduce"]:
        fail("08.3", "stage 3 needs no all-reduce: reduce-scatter each unit's gradients")
    reduced = got["reduce_scatter"] + comm.bytes.get("reduce", 0)
    if not psi_bytes <= reduced <= psi_bytes + slack:
        fail("08.3", f"rank {r} reduce-scattered (or reduced) {reduced:,} bytes in a step; "
             f"each unit's gradients once ({psi_bytes:,} bytes, Ψ, plus padding)")  # fmt: skip
    if not 2 * psi_bytes <= got["all_gather"] <= 2 * (psi_bytes + slack):
        fail("08.3", f"rank {r} all-gathered {got['all_gather']:,} bytes in a step; each unit "
             f"once before its forward and once before its backward ({2 * psi_bytes:,}, 2Ψ)")  # fmt: skip


def _stage3_memory_and_bytes(ctx, zero3_cls) -> None:
    """On the MLP: one unit gathered at a time, full gradients dropped once reduce-scattered,
    nothing held between steps, 3Ψ per step."""
    n, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    model = ToyMLP().to(ctx.device, torch.float64)
    units = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    unit_bytes = [sum(p.numel() * 8 for p in m.parameters(recurse=False)) for m in units]
    z = zero3_cls(model, torch.optim.SGD, {"lr": 0.1})
    peak, grad_peak = _watch_peaks(model, z, units)
    if _held_bytes(model, z):
        fail("08.3", f"rank {r} holds {_held_bytes(model, z):,} bytes of full parameters right "
             "after building the class: between uses a rank keeps its shards only")  # fmt: skip
    x = torch.randn(8, 16, dtype=torch.float64, device=ctx.device)
    y = torch.randint(4, (8,), device=ctx.device)
    with CollectiveCounter() as comm, no_store("08.3"):
        nn.functional.cross_entropy(model(x), y).backward()
        z.step()
    slack = 8 * n * len(units)  # padding
    if peak[0] > max(unit_bytes) + slack:
        fail("08.3", f"rank {r} held {peak[0]:,} bytes of full parameters at once, more than "
             f"the largest unit ({max(unit_bytes):,}): free each unit right after its forward, "
             "and after its backward")  # fmt: skip
    if grad_peak[0] > 1:
        fail("08.3", f"rank {r} held the full gradients of {grad_peak[0]} layers at once "
             "during backward: once a unit's gradients are reduce-scattered into its shard, "
             "drop the full ones (p.grad = None), or stage 3 keeps DDP's gradient memory")  # fmt: skip
    if _held_bytes(model, z):
        fail("08.3", f"after the step rank {r} still holds {_held_bytes(model, z):,} bytes of "
             "full parameters: free each unit once its gradients are reduce-scattered")  # fmt: skip
    _judge_stage3_bytes(r, comm, unit_bytes, slack)


def _stage3_parity(ctx, zero3_cls) -> None:
    """Three steps of the MLP, the tied and the frozen model, each equal to one process."""

    n, r = ctx.world_size, ctx.rank
    for model_name, opt in (("mlp", "adam"), ("tied", "adam"), ("frozen", "sgd")):
        built = []

        def method(model, optimizer_class, options, built=built):
            z = zero3_cls(model, optimizer_class, options)
            built.append((model, z))
            return model, z, z.full_parameters

        out = zero_run.parity_worker(ctx, method, model=model_name, optimizer=opt, steps=3,
                                     global_batch=12 * n)  # fmt: skip
        worst = worst_of(out["diffs"])  # NaN if any is NaN
        if not worst < 1e-12:
            if _held_bytes(built[0][0], built[0][1]):
                hint = ("units were still gathered after the step, so the next forward found "
                        "them present and ran on stale parameters: free each unit after its "
                        "forward and after its backward")  # fmt: skip
            elif out["diffs"][0] < 1e-12:
                hint = ("the first step equals one process and a later one does not: "
                        "something your class counts or keeps from one step to the next is "
                        "not reset (the gradients arrived per unit, a flag, a gradient left in "
                        "place)")  # fmt: skip
            else:
                hint = ("each unit's gradient shard is the reduce-scatter of its full "
                        "gradients, divided by n; the optimizer steps the shards")  # fmt: skip
            fail("08.3", f"{model_name} model, {opt}, {n} ranks: rank {r}'s parameters differ "
                 f"from one process by {worst:.2g} after 3 steps: {hint}")  # fmt: skip


def _stage3_worker(ctx, zero3_cls):
    """One rank of check 08.3: memory and traffic on the MLP, then parity on three models."""
    with _stage3_guard(ctx.rank):
        _stage3_memory_and_bytes(ctx, zero3_cls)
        _stage3_parity(ctx, zero3_cls)
    dist.barrier()
    return True


def check_zero3(zero3_cls) -> None:
    """Exercise 08.3: a ``Zero3(model, optimizer_class, options)`` whose units are gathered before
    their forward and their backward, freed after each, and whose gradients are reduce-scattered
    after their backward: equal to one process (tied and frozen layers included), one unit held
    at a time, 3Ψ per step."""

    for n in (2, 3):
        launch_check("08.3", _stage3_worker, n, zero3_cls=zero3_cls, timeout=120)
    passed("08.3", "equal to one process on 2 and 3 ranks (tied and frozen layers), one unit "
           "gathered at a time, Ψ reduce-scattered and 2Ψ all-gathered per step")  # fmt: skip


__all__ = ["ExerciseError", "check_shard_bounds", "check_zero1_step", "check_zero3"]
