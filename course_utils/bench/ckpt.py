"""``python -m course_utils bench ckpt``: a sharded checkpoint's save and load speed per rank, and
the training stall of DCP's ``async_save`` against a synchronous save (notebook 11, section 4).

The state: an MLP of 4 ``width × width`` layers under FSDP2 (``fully_shard``, every rank holds
``1/P`` of each parameter and of its Adam moments), float32 Adam; ``--mb`` sets its size (the
parameters and both moments). On ``P`` ranks, in one launch, ``rounds`` interleaved rounds (the
order of the two methods reversed every other round), each of:

- **save, load:** the course's :func:`~course_utils.checkpoint.sharded.save` (its index, one file
  per rank, fsynced, renamed into place) and DCP's synchronous ``save`` (``__<r>_0.distcp`` per rank
  and ``.metadata``; DCP's writer fsyncs too), each to a fresh folder; then each loaded into a
  fresh model whose tensors were zeroed (so a load must write every value) and compared with the
  saved state. Times are each rank's, from a common barrier to its own return; the slowest rank's
  counts. Bytes per rank: the files on disk. MB/s per rank: the fullest rank's bytes over the
  slowest rank's seconds. The load reads files just written, from the page cache.
- **stall:** what notebook 11's ``async_stalls`` measures: three arms (their order rotated round by
  round), each ``steps_after`` training steps (by default as many as last twice a synchronous
  save, :func:`~course_utils.checkpoint.dcp.steps_to_outlast_a_save`, so that an async write can
  finish behind them) after no save, after a synchronous ``dcp.save``, and
  after a ``dcp.async_save`` on a gloo group of its own followed by the wait on its future. The
  stall of a save is its arm's time minus the no-save arm's, in the same round: it includes what
  the background writer (a thread of the training process) slows the steps it overlaps. The
  slowest rank's times count.

    python -m course_utils bench ckpt --world-sizes 1 2 4 --rounds 5 --mb 24
"""

from __future__ import annotations

import functools
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import dcp as course_dcp
from ..checkpoint import layouts
from ..checkpoint.sharded import ShardedState
from ..checkpoint.sharded import load as sharded_load
from ..checkpoint.sharded import save as sharded_save
from ..compat import fsdp2_unsupported
from ..launcher import launch
from ..zero.run import wrap
from . import provenance

LAYERS, BATCH = 4, 16
METHODS = ("sharded", "dcp")
ARMS = ("none", "sync", "async")  # the stall's rounds: no save, a synchronous one, an async one


def width_for(mb: float) -> int:
    """The width whose MLP's state (parameters and two Adam moments, float32) is about ``mb``
    MB: ``3 · 4 bytes · LAYERS · (w² + w)``; a multiple of 8, at least 8."""
    w = math.sqrt(mb * 1e6 / (3 * 4 * LAYERS))
    return max(8, round(w / 8) * 8)


def _model(width: int, device, seed: int):
    torch.manual_seed(seed)
    mlp = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(LAYERS)])
    model, opt, _ = wrap("fsdp2", mlp.to(device), "adam", device)
    return model, opt


def _timed(fn) -> float:
    """This rank's seconds for ``fn()`` from a barrier all ranks pass."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _slowest(seconds: float, device) -> float:
    """The largest of every rank's ``seconds``."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank_files(folder: Path, method: str, rank: int) -> int:
    name = f"shard-{rank}.pt" if method == "sharded" else f"__{rank}_0.distcp"
    return (folder / name).stat().st_size if (folder / name).exists() else 0


def _save(method: str, model, opt, folder: Path, rank: int, n: int) -> None:
    if method == "sharded":
        sharded_save(ShardedState(layouts.fsdp2(model, opt)), folder, rank=rank, world_size=n)
    else:
        course_dcp.save(model, opt, folder)


def _load(method: str, fresh, opt, folder: Path, rank: int) -> None:
    if method == "sharded":
        sharded_load(folder, layouts.fsdp2(fresh, opt), rank=rank)
    else:
        course_dcp.load(fresh, opt, folder)


def _save_load_round(ctx, model, opt, fresh, root: Path, i: int) -> dict:
    """One round of both saves, then both loads (order reversed on odd rounds): seconds, bytes,
    and the largest difference between the loaded and the saved tensors."""
    r, n = ctx.rank, ctx.world_size
    order = METHODS if i % 2 == 0 else METHODS[::-1]
    out = {m: {} for m in METHODS}
    for m in order:
        folder = root / f"{m}-{i}"
        save = functools.partial(_save, m, model, opt, folder, r, n)
        out[m]["save_s"] = _slowest(_timed(save), ctx.device)
        out[m]["bytes"] = _rank_files(folder, m, r)
    for m in order:
        with torch.no_grad():
            for _, t in layouts.fsdp2(*fresh):
                t.zero_()  # the load must write every value
        load = functools.partial(_load, m, *fresh, root / f"{m}-{i}", r)
        out[m]["load_s"] = _slowest(_timed(load), ctx.device)
        pairs = zip(layouts.fsdp2(model, opt), layouts.fsdp2(*fresh))
        out[m]["diff"] = max(float((a - b).abs().max()) for (_, a), (_, b) in pairs)
    return out


def _round(kind: str, model, opt, step, folder: Path, group, steps_after: int) -> tuple:
    """(the round's seconds, the save call's part): a save of ``kind`` (``"none"``, ``"sync"``,
    ``"async"``), ``steps_after`` training steps, then the wait for an async save's future."""
    t0 = time.perf_counter()
    pending = None
    if kind == "sync":
        course_dcp.save(model, opt, folder)
    elif kind == "async":
        pending = course_dcp.async_save(model, opt, folder, process_group=group)
    call = time.perf_counter() - t0
    for _ in range(steps_after):
        step()  # training goes on while an async save writes (and is slowed by it)
    if pending is not None:
        pending.result()  # the caller waits before the next save: async_save does not
    return time.perf_counter() - t0, call


def ckpt_worker(ctx, root: str, width: int, rounds: int, steps_after: int) -> dict:
    """Every round's save/load times and stalls on this rank (slowest rank's where reduced)."""
    root = Path(root)
    model, opt = _model(width, ctx.device, seed=0)
    fresh = _model(width, ctx.device, seed=7)
    layouts.init_optimizer_state(fresh[1])  # Adam's state exists after a first step
    x = torch.randn(BATCH, width, device=ctx.device)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    group = course_dcp.checkpoint_group()  # the background save's own group
    if steps_after <= 0:  # enough steps for an async write to finish behind them
        warm = functools.partial(course_dcp.save, model, opt, root / "warm")
        steps_after = course_dcp.steps_to_outlast_a_save(warm, step, ctx.device)
    rows, stalls = [], {"none_round": [], "sync": [], "async": [], "async_call": []}
    for i in range(rounds):
        rows.append(_save_load_round(ctx, model, opt, fresh, root, i))
        seconds = {}
        for kind in ARMS[i % 3 :] + ARMS[: i % 3]:  # the arms' order rotates round by round
            dist.barrier()
            t, call = _round(kind, model, opt, step, root / f"{kind}-{i}", group, steps_after)
            seconds[kind] = _slowest(t, ctx.device)
            if kind == "async":
                stalls["async_call"].append(_slowest(call, ctx.device))
        stalls["none_round"].append(seconds["none"])
        for kind in ("sync", "async"):  # the stall: the round's excess over the no-save round
            stalls[kind].append(seconds[kind] - seconds["none"])
        dist.barrier()
        if ctx.rank == 0:
            for p in root.glob(f"*-{i}"):
                shutil.rmtree(p)
    held = sum(t.numel() * t.element_size() for _, t in layouts.fsdp2(model, opt))
    return {
        "rounds": rows,
        "stalls": stalls,
        "held_bytes": held,
        "tensors": len(layouts.fsdp2(model, opt)),
        "steps_after": steps_after,
    }


def _row(n: int, results: list[dict]) -> dict:
    rounds = [res["rounds"] for res in results]
    row = {"P": n, "held_bytes_per_rank": [res["held_bytes"] for res in results],
           "tensors_per_rank": results[0]["tensors"], "steps_after": results[0]["steps_after"],
           **results[0]["stalls"]}  # fmt: skip
    for m in METHODS:
        row[m] = {
            "bytes_per_rank": [rr[-1][m]["bytes"] for rr in rounds],
            "save_s": [rd[m]["save_s"] for rd in rounds[0]],
            "load_s": [rd[m]["load_s"] for rd in rounds[0]],
            "load_max_diff": max(rd[m]["diff"] for rr in rounds for rd in rr),
        }
    return row


def run(world_sizes=(1, 2, 4), rounds: int = 5, mb: float = 24.0, folder=None,
        steps_after: int = 0, device: str = "cpu") -> dict:  # fmt: skip
    """The benchmark on each world size (one launch each); files under ``folder`` (default: a
    temporary one), removed afterwards."""
    why = fsdp2_unsupported(torch.device(device).type)
    if why:
        raise RuntimeError(why)
    width, rows, backend = width_for(mb), [], None
    base = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=folder))
    try:
        for n in world_sizes:
            res = launch(ckpt_worker, n, root=str(base / f"P{n}"), width=width, rounds=rounds,
                         steps_after=steps_after, device=device, echo=False, progress=False)  # fmt: skip
            rows.append(_row(n, res.results))
            backend = res.backend
    finally:
        shutil.rmtree(base, ignore_errors=True)
    state = 3 * 4 * LAYERS * (width * width + width)
    return {"world_sizes": list(world_sizes), "rounds": rounds, "backend": backend,
            "config": {"width": width, "layers": LAYERS, "state_bytes": state, "mb": mb,
                       "steps_after": steps_after, "dtype": "float32", "optimizer": "Adam",
                       "layout": "FSDP2 fully_shard"},
            "rows": rows, **provenance()}  # fmt: skip


def conclude(a: list[float], b: list[float], what_a: str, what_b: str) -> str:
    """What the spread allows: ``a`` below (above) ``b`` only when every round of one lies under
    every round of the other (their min–max ranges do not overlap)."""
    if max(a) < min(b):
        return f"{what_a} below {what_b} in every round"
    if min(a) > max(b):
        return f"{what_a} above {what_b} in every round"
    return f"ranges of {what_a} and {what_b} overlap: no difference can be claimed"


def _spread(xs: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
    return (f"{statistics.median(xs) * scale:{fmt}} "
            f"({min(xs) * scale:{fmt}}-{max(xs) * scale:{fmt}})")  # fmt: skip


def table(r: dict) -> str:
    c = r["config"]
    out = [
        f"MLP {c['layers']} x {c['width']}x{c['width']} under {c['layout']}, {c['dtype']} "
        f"{c['optimizer']}: {c['state_bytes'] / 1e6:.1f} MB of state; {r['backend']}, "
        f"{r['rounds']} interleaved rounds; {r['machine']}, {r['date']}",
        "",
        "| P | method | MB written / rank (max) | save s, slowest rank | save MB/s / rank | "
        "load s, slowest rank | load MB/s / rank | loaded = saved |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in r["rows"]:
        for m in METHODS:
            d = row[m]
            mb = max(d["bytes_per_rank"]) / 1e6
            out.append(
                f"| {row['P']} | {m} | {mb:.2f} | {_spread(d['save_s'])} | "
                f"{mb / statistics.median(d['save_s']):.0f} | {_spread(d['load_s'])} | "
                f"{mb / statistics.median(d['load_s']):.0f} | {d['load_max_diff'] == 0.0} |"
            )
    out += ["", "stall per checkpoint: a round of k training steps after the save, minus the same "
            "round without a save (median (min-max) ms, slowest rank); k: "
            + ("as many steps as last twice a sync save" if not c["steps_after"] else
               f"{c['steps_after']} (--steps-after)"), "",
            "| P | k | sync save | async_save + wait | its call (staging) | async / sync |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for row in r["rows"]:
        q = statistics.median(row["async"]) / statistics.median(row["sync"])
        out.append(
            f"| {row['P']} | {row['steps_after']} | {_spread(row['sync'], 1e3, '.1f')} | "
            f"{_spread(row['async'], 1e3, '.1f')} | {_spread(row['async_call'], 1e3, '.1f')} | "
            f"{q:.2f} |"
        )
    out.append("")
    for row in r["rows"]:
        q = statistics.median(row["async"]) / statistics.median(row["sync"])
        said = [
            f"stall, async / sync {q:.2f}: {conclude(row['async'], row['sync'], 'async', 'sync')}"
        ]
        for what in ("save", "load"):
            s, d = row["sharded"][f"{what}_s"], row["dcp"][f"{what}_s"]
            q = statistics.median(s) / statistics.median(d)
            said.append(f"{what} time, sharded / DCP {q:.2f}: {conclude(s, d, 'sharded', 'DCP')}")
        out.append(f"P={row['P']}: " + "; ".join(said))
    return "\n".join(out)
