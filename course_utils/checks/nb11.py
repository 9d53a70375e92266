"""Checks for notebook 11 (checkpoints and failures): a sharded save and load with an index (11.1),
what a restart must put back to equal an uninterrupted run (11.2), the interval of best goodput
(11.3)."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..checkpoint import dcp as course_dcp
from ..checkpoint import interval, layouts, resume, sharded
from ..checkpoint.sharded import ShardedState, Slice
from ..zero import ShardedOptimizer
from .common import ExerciseError, fail, launch_check, passed, refuse_calls

PACKAGE_SAVE = (
    "that is the package's sharded checkpoint (course_utils.checkpoint) or torch's DCP, which "
    "the check compares with: write the files and the index yourself"
)
PACKAGE_RESUME = (
    "that is the package's resume helper (course_utils.checkpoint.resume), which the check "
    "compares with: take and put back the state yourself"
)
PACKAGE_INTERVAL = (
    "that is the package's interval (course_utils.checkpoint.interval), which the check compares "
    "with: compute the MTBF and search for the best τ yourself (interval.goodput, the model, you "
    "may call)"
)


def _dcp_functions() -> list:
    import torch.distributed.checkpoint as tdcp

    found = [course_dcp.save, course_dcp.load, course_dcp.async_save]
    for name in ("save", "load", "async_save", "save_state_dict", "load_state_dict"):
        fn = getattr(tdcp, name, None)
        if fn is not None:
            found.append(fn)
    return found


def _refuse_saves():
    return refuse_calls("11.1", [sharded.save, sharded.load, *_dcp_functions()], PACKAGE_SAVE)


# ---- 11.1: sharded save and load --------------------------------------------------------------

# name -> global shape; how two saving ranks cut it (a dim, or None: whole on both)
SAVED = {"w": ((6, 5), 0), "v": ((4, 6), 1), "b": ((8192,), None), "step": ((), None)}
# how the loading ranks want it: another cut of each
WANTED = {"w": 1, "v": 0, "b": 0, "step": None}
BUFFER_PAD = 32768  # elements of the flat buffer the saving ranks' tensors are views of


def _whole_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1101)
    return {
        n: torch.randn(shape, generator=g, dtype=torch.float64) for n, (shape, _) in SAVED.items()
    }


def _slice(name: str, shape, dim, rank: int, n: int) -> Slice:
    if dim is None:
        return layouts.whole(name, torch.empty(shape))[0]
    return layouts.chunk_slice(name, shape, dim, rank, n)


def _box(t: torch.Tensor, s: Slice) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.lengths))]


def _saving_pieces(rank: int, n: int, device) -> list:
    """This rank's (Slice, tensor) pairs, each tensor a view of one flat buffer (as ZeRO's are)."""
    whole = {k: v.to(device) for k, v in _whole_tensors().items()}
    slices = [_slice(name, shape, dim, rank, n) for name, (shape, dim) in SAVED.items()]
    flat = torch.zeros(
        sum(s.numel for s in slices) + BUFFER_PAD, dtype=torch.float64, device=device
    )
    out, at = [], 0
    for s in slices:
        view = flat[at : at + s.numel].view(s.lengths)
        view.copy_(_box(whole[s.name], s))
        out.append((s, view))
        at += s.numel
    return out


def _wanted_pieces(rank: int, n: int, device) -> list:
    """Another layout: each tensor cut along another dim (NaN until loaded)."""
    out = []
    for name, (shape, _) in SAVED.items():
        dim = WANTED[name] if n > 1 else None
        s = _slice(name, shape, dim, rank, n)
        out.append((s, torch.full(s.lengths, float("nan"), dtype=torch.float64, device=device)))
    return out


def _compare_loaded(pieces, where: str) -> None:
    whole = _whole_tensors()
    for s, t in pieces:
        want = _box(whole[s.name], s)
        got = t.detach().cpu()
        if got.shape != want.shape:
            fail("11.1", f"{where}: {s.name!r} has shape {tuple(got.shape)} after the load, "
                 f"{tuple(want.shape)} wanted: fill the tensors of `want` in place")  # fmt: skip
        if torch.equal(got, want):
            continue
        holes = int(got.isnan().sum())
        if holes == got.numel():
            fail("11.1", f"{where}: {s.name!r} was not filled at all: load_sharded must copy "
                 "into the tensors of `want` in place (t.copy_(...)), not return new ones")  # fmt: skip
        if holes:
            fail("11.1", f"{where}: {holes} of {got.numel()} elements of {s.name!r} were never "
                 "filled: a wanted box can overlap several saved ones (other ranks' files); copy "
                 "the overlap of every saved slice the index lists")  # fmt: skip
        bad = int((got != want).sum())
        fail("11.1", f"{where}: {bad} of {got.numel()} elements of {s.name!r} differ from what "
             "was saved: the index must say which file holds which box of each tensor, and the "
             "load copies each saved box's overlap with the wanted one to the right place")  # fmt: skip


@contextlib.contextmanager
def _late_writer(late: bool, delay: float = 0.4):
    """On the late rank, start the save later and slow each torch.save, so that a save which
    returns without waiting for the other ranks returns before their files exist."""
    if not late:
        yield
        return
    time.sleep(delay)
    original = torch.save

    def slow_save(*args, **kwargs):
        time.sleep(delay)
        return original(*args, **kwargs)

    torch.save = slow_save
    try:
        yield
    finally:
        torch.save = original


def _loads_whole_checkpoint(load_sharded, folder, r: int, n: int, device) -> bool:
    """Whether a load right after this rank's save returned finds every saved box."""
    want = _wanted_pieces(r, n, device)
    try:
        with _refuse_saves():
            load_sharded(folder, want, r)
    except ExerciseError:
        raise
    except Exception:  # a file or the index not there yet, or the load's own bug (judged later)
        return False
    whole = _whole_tensors()
    return all(torch.equal(t.detach().cpu(), _box(whole[s.name], s)) for s, t in want)


def _save_load_worker(ctx, save_sharded, load_sharded, folder):
    n, r = ctx.world_size, ctx.rank
    with _refuse_saves(), _late_writer(r == n - 1):
        save_sharded(_saving_pieces(r, n, ctx.device), folder, r, n)
    early = _loads_whole_checkpoint(load_sharded, folder, r, n, ctx.device)
    dist.barrier()  # every rank's save returned: the checkpoint is complete
    want = _wanted_pieces(r, n, ctx.device)
    with _refuse_saves():
        load_sharded(folder, want, r)
    _compare_loaded(want, f"rank {r} of {n}, loading the checkpoint cut another way")
    if not early:
        fail("11.1", f"rank {r}'s save_sharded returned before the checkpoint was complete: a "
             "load called right after it found another rank's file or the index missing (it "
             "loads equal once every rank has finished). End the save with dist.barrier(), so "
             "that no rank returns before every rank's files are written")  # fmt: skip
    return True


def _files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check_sharded_checkpoint(save_sharded, load_sharded) -> None:
    """Exercise 11.1: ``save_sharded(pieces, folder, rank, world_size)`` on every rank, then
    ``load_sharded(folder, want, rank)`` fills ``want`` in place, under any layout."""
    with tempfile.TemporaryDirectory(prefix="check11_") as tmp:
        folder = Path(tmp) / "step-00000001"
        launch_check("11.1", _save_load_worker, 2, save_sharded=save_sharded,
                     load_sharded=load_sharded, folder=str(folder), timeout=120)  # fmt: skip
        if not folder.is_dir():
            fail("11.1", f"nothing was written at {folder}: save into the folder given")
        unique = sum(math.prod(shape) for shape, _ in SAVED.values()) * 8
        excess = _files_bytes(folder) - unique
        if excess > 300_000:
            fail("11.1", f"the checkpoint's files hold {_files_bytes(folder):,} bytes for "
                 f"{unique:,} bytes of tensors: torch.save writes a view's whole storage (here a "
                 "flat buffer, as ZeRO's shards are); save a contiguous copy (clone) of each "
                 "piece")  # fmt: skip
        if excess > 40_000:
            fail("11.1", f"the checkpoint's files hold {_files_bytes(folder):,} bytes for "
                 f"{unique:,} bytes of tensors: 'b', whole on both ranks (replicated), is written "
                 "more than once; let one rank (the lowest that holds a slice) write it")  # fmt: skip
        want = _wanted_pieces(0, 1, "cpu")
        with _refuse_saves():
            try:
                load_sharded(str(folder), want, 0)
            except (RuntimeError, ValueError) as e:
                if "process group" not in str(e) and "init_process_group" not in str(e):
                    raise
                fail("11.1", "load_sharded needed a process group: a load reads files only, "
                     "with no communication, so one process without ranks can read it")  # fmt: skip
        _compare_loaded(want, "one process loading every tensor whole")
    passed("11.1", "saved by 2 ranks (a replicated tensor written once, views saved as their own "
           "bytes), loaded equal under another cut on 2 ranks and whole by one process without a "
           "process group")  # fmt: skip


# ---- 11.2: resume bit for bit -----------------------------------------------------------------

SAMPLES, PER_RANK = 64, 4


def _net(seed: int, device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)).to(
        device, torch.float64
    )


def _rng(device) -> dict:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _resume_worker(ctx, snapshot, restore, root, steps, save_at, restart):
    """ZeRO-1 training with dropout and noisy inputs drawn from each rank's own generator, over
    a DistributedSampler reshuffled every epoch (8 steps); saves after ``save_at`` through the
    student's ``snapshot``, or starts from that checkpoint through their ``restore``."""
    n, r = ctx.world_size, ctx.rank
    model = _net(9 if restart else 0, ctx.device)
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    data = torch.Generator().manual_seed(5)
    xs = torch.randn(SAMPLES, 16, generator=data, dtype=torch.float64).to(ctx.device)
    ys = torch.randint(4, (SAMPLES,), generator=data).to(ctx.device)
    torch.manual_seed(100 + r)
    step, pos, out = 0, resume.DataPosition(seed=3), {"batches": {}, "losses": {}}

    def refuse():
        refs = [resume.capture, resume.restore, resume.rng_states, resume.set_rng_states]
        return refuse_calls("11.2", refs, PACKAGE_RESUME)

    if restart:
        layouts.init_optimizer_state(opt)
        loaded = sharded.load(Path(root) / "ckpt", layouts.zero(model, opt, r), rank=r)
        layouts.zero_after_load(model, opt)
        with refuse():
            got = restore(loaded.meta, loaded.per_rank, ctx.device)
        if not (isinstance(got, tuple) and len(got) == 2):
            fail("11.2", "restore_state must return (step, position)")
        step, pos = got
        out["rng_after_restore"] = _rng(ctx.device)
        out["restart_step"] = step
    while step < steps:
        idx = pos.batch(SAMPLES, PER_RANK, r, n)
        x = xs[idx] + 0.1 * torch.randn(len(idx), 16, dtype=torch.float64, device=ctx.device)
        loss = F.cross_entropy(model(x), ys[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        pos.advance(SAMPLES // (PER_RANK * n))
        out["batches"][step] = list(idx)
        out["losses"][step] = loss.item()
        if step == save_at:
            out["rng_at_save"] = _rng(ctx.device)
            with refuse():
                got = snapshot(step, pos, ctx.device)
            _save_snapshot(got, model, opt, Path(root) / "ckpt", r, n)
            if not torch.equal(torch.get_rng_state(), out["rng_at_save"]["cpu"]):
                fail("11.2", "snapshot_state changed this rank's random generator (it drew "
                     "random numbers): take the state, draw nothing")  # fmt: skip
    out["params"] = {k: p.detach().cpu().clone() for k, p in model.named_parameters()}
    return out


def _save_snapshot(got, model, opt, folder: Path, r: int, n: int) -> None:
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(d, dict) for d in got)):
        fail("11.2", "snapshot_state must return two dicts: (meta, per_rank)")
    meta, per_rank = got
    try:
        json.dumps(meta)
    except TypeError as e:
        fail("11.2", f"meta is written as JSON in the index, once for all ranks ({e}): keep "
             "tensors (random states) in per_rank, this rank's own file")  # fmt: skip
    sharded.save(ShardedState(layouts.zero(model, opt, r), meta, per_rank), folder, rank=r,
                 world_size=n)  # fmt: skip


def _same_rng(a: dict, b: dict) -> bool:
    return all(k in b and torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _judge_resume(whole, again, save_at: int, steps: int) -> None:
    for r, (w, a) in enumerate(zip(whole, again)):
        if a["restart_step"] != save_at:
            fail("11.2", f"restore_state returned step {a['restart_step']!r}; the checkpoint was "
                 f"saved after step {save_at}: save the step in meta")  # fmt: skip
        first = save_at + 1
        if a["batches"].get(first) != w["batches"][first]:
            fail("11.2", f"rank {r}'s first batch after the restart is not the one the "
                 f"uninterrupted run drew at step {first}: save the data position (the epoch, "
                 "the step within it, the sampler's seed) and give it back")  # fmt: skip
        if not _same_rng(w["rng_at_save"], a["rng_after_restore"]):
            other = whole[1 - r]["rng_at_save"]
            if _same_rng(other, a["rng_after_restore"]):
                fail("11.2", f"rank {r} got rank {1 - r}'s random state back: each rank draws "
                     "its own dropout masks and noise, so each keeps its own state (per_rank), "
                     "not one shared in meta")  # fmt: skip
            fail("11.2", f"rank {r}'s random generator after restore_state is not its state at "
                 "the save, so its dropout masks and noise differ from the uninterrupted run's: "
                 "save torch.get_rng_state() (and the GPU's) per rank and set it back")  # fmt: skip
    for r, (w, a) in enumerate(zip(whole, again)):  # every rank's state first: ZeRO mixes them
        for s in range(save_at + 1, steps + 1):
            if a["batches"].get(s) != w["batches"][s]:
                fail("11.2", f"rank {r}'s batch at step {s} differs from the uninterrupted run's "
                     "(an epoch boundary lies between): save the epoch as well as the step "
                     "within it")  # fmt: skip
            if a["losses"][s] != w["losses"][s]:
                fail("11.2", f"rank {r}'s loss at step {s} differs from the uninterrupted run's "
                     "(not bit for bit)")  # fmt: skip
        for k, p in w["params"].items():
            if not torch.equal(p, a["params"][k]):
                fail("11.2", f"rank {r}'s {k} after step {steps} differs from the uninterrupted "
                     "run's")  # fmt: skip


def check_resume(snapshot_state, restore_state) -> None:
    """Exercise 11.2: ``snapshot_state(step, position, device) -> (meta, per_rank)`` at a save,
    ``restore_state(meta, per_rank, device) -> (step, position)`` at a restart."""
    with tempfile.TemporaryDirectory(prefix="check11_") as tmp:
        for save_at, steps in ((10, 13), (6, 9)):  # inside epoch 1 (8 steps each); in epoch 0
            root = Path(tmp) / f"at{save_at}"
            kw = dict(snapshot=snapshot_state, restore=restore_state, root=str(root), steps=steps,
                      save_at=save_at, timeout=120)  # fmt: skip
            whole = launch_check("11.2", _resume_worker, 2, restart=False, **kw).results
            again = launch_check("11.2", _resume_worker, 2, restart=True, **kw).results
            _judge_resume(whole, again, save_at, steps)
    passed("11.2", "restarted from a checkpoint after step 6 and after step 10 (in the second "
           "epoch), 2 ranks with dropout and noise: every loss and parameter bit for bit equal "
           "to the uninterrupted run's")  # fmt: skip


# ---- 11.3: the interval that maximizes goodput ------------------------------------------------

HIDDEN = interval.FailureRecord(interruptions=70, unexpected=61, days=21, gpus=3072,
                                source="a made-up record for the check")  # fmt: skip
# (cost, restart, job GPUs, record): a cheap save (Young's formula holds), then costlier ones, up to
# C = 0.2 M, where Young's interval is 25 % too long
INTERVAL_CASES = [(5.0, 300.0, 1024, interval.LLAMA3), (60.0, 600.0, 16384, interval.LLAMA3),
                  (300.0, 900.0, 4096, HIDDEN), (2000.0, 600.0, 9216, HIDDEN)]  # fmt: skip
TAU_TOLERANCE = 0.01  # a τ this close to the best passes
GOODPUT_TOLERANCE = 1e-6  # so does one whose goodput is this close to the best's
YOUNG_FIRST_ORDER = (
    "that is Young's sqrt(2·C·M): the first-order formula misses the optimum when saves are "
    "costly (here C/M = {:.3g} already puts it more than 1% off); search Daly's goodput, "
    "interval.goodput(τ, C, R, M), for the τ that maximizes it (Young's τ is a good place to "
    "start, the optimum lies below it)"
)


def _candidates(cost: float, restart: float, gpus: int, rec) -> dict[str, tuple[float, ...]]:
    """The intervals the usual slips give (the best one for a wrong MTBF or swapped costs, and
    Young's for the same), each with its hint; a wrong MTBF that equals the right one for this
    case (the record's own job size) is left out."""
    per_job = rec.days * interval.DAY / rec.unexpected
    m = per_job * rec.gpus / gpus
    wrong_m = {
        "the MTBF of the published job was used as is: a job of fewer GPUs fails less often "
        "(M = M_published · published GPUs / your GPUs)": per_job,
        "the published GPUs over yours is upside down: fewer GPUs fail less often, so the MTBF "
        "grows": per_job * gpus / rec.gpus,
        "all interruptions were counted: the planned ones (maintenance) do not strike at "
        "random; count the unexpected ones": rec.days
        * interval.DAY
        / rec.interruptions
        * rec.gpus
        / gpus,
        "the MTBF must be in seconds, like the cost (it came out in hours)": m / 3600,
    }
    out = {h: (interval.best_interval(cost, restart, w), interval.young_interval(cost, w))
           for h, w in wrong_m.items() if not math.isclose(w, m)}  # fmt: skip
    out["the interval must be in seconds, like the cost (it came out in hours)"] = (
        interval.best_interval(cost, restart, m) / 3600,
    )
    out["cost and restart are swapped: interval.goodput(τ, C, R, M) takes the save's cost C "
        "before the restart R"] = (interval.best_interval(restart, cost, m),)  # fmt: skip
    return out


def _judge_interval(got, cost, restart, gpus, rec, best, hints) -> None:
    """Fail with the slip ``got`` matches, else with how far its goodput falls short."""
    where = f"C = {cost:g} s, R = {restart:g} s on {gpus:,} GPUs with a record of {rec.gpus:,}"
    try:
        got = float(got)
    except (TypeError, ValueError):
        fail("11.3", f"return a number of seconds, not {type(got).__name__}")
    if not got > 0 or math.isinf(got):
        fail("11.3", f"with {where}: return a positive, finite number of seconds, not {got}")
    m = rec.days * interval.DAY / rec.unexpected * rec.gpus / gpus
    g_best, g = interval.goodput(best, cost, restart, m), interval.goodput(got, cost, restart, m)
    if abs(got / best - 1) <= TAU_TOLERANCE or g >= g_best - GOODPUT_TOLERANCE:
        return
    for hint, values in hints.items():
        if any(math.isclose(got, v, rel_tol=TAU_TOLERANCE) for v in values):
            fail("11.3", f"with {where}: {hint}")
    if math.isclose(got, interval.young_interval(cost, m), rel_tol=2e-3):
        fail("11.3", f"with {where}: {YOUNG_FIRST_ORDER.format(cost / m)}")
    fail("11.3", f"with {where}, your τ is too {'long' if got > best else 'short'}: its goodput "
         f"{g:.6f} is {g_best - g:.2g} below the best τ's. M = days · 86,400 / unexpected "
         "interruptions · record GPUs / job GPUs; then find the τ that maximizes "
         f"interval.goodput(τ, C, R, M) to within {TAU_TOLERANCE:.0%} (a coarse grid or a loose "
         "search stops short)")  # fmt: skip


def check_interval(checkpoint_interval) -> None:
    """Exercise 11.3: ``checkpoint_interval(cost, restart, gpus, record) -> seconds``, the work
    between checkpoints that maximizes Daly's goodput, found by a search the student writes."""
    wants, hints = [], []
    for cost, restart, gpus, rec in INTERVAL_CASES:  # before the package's functions are refused
        wants.append(interval.best_interval(cost, restart, rec.job_mtbf(gpus)))
        hints.append(_candidates(cost, restart, gpus, rec))
    refs = [interval.young_interval, interval.daly_interval, interval.best_interval,
            interval.FailureRecord.job_mtbf]  # fmt: skip
    with refuse_calls("11.3", refs, PACKAGE_INTERVAL):
        gots = [checkpoint_interval(*case) for case in INTERVAL_CASES]
    for got, case, best, hint in zip(gots, INTERVAL_CASES, wants, hints):
        _judge_interval(got, *case, best, hint)
    passed("11.3", f"the τ of best goodput within {TAU_TOLERANCE:.0%} for four costs, from "
           "C/M = 3e-5 to 0.2, job sizes and two failure records")  # fmt: skip
