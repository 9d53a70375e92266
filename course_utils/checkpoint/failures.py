"""A rank dies, the job resumes from its last checkpoint, and ends as if nothing had happened.

:func:`train_worker` is a small data-parallel training (float64, dropout, Adam, a shuffled
``DistributedSampler`` order, noise from each rank's own generator) that saves a sharded checkpoint
(:mod:`.sharded`) every ``every`` steps and, on start, resumes from the newest complete one. One
chosen rank can die in the middle of a chosen step, after its backward and before the gradients'
all-reduce, by ``os._exit(1)`` (a crash: no exception, no clean-up) or by raising.

- :func:`crash_and_resume`: the same under :func:`course_utils.launch`, twice: the first launch
  raises :class:`~course_utils.launcher.errors.RankFailedError` naming the rank, the second resumes;
- :mod:`.elastic_demo`: the same under ``torchrun --max-restarts 1``, which restarts every rank
  itself;
- :func:`lost_work`: what the failure cost, from the ranks' event logs (steps done twice, seconds).

**What travels.** Each step, one ``all_reduce`` per parameter's gradient (summed, then divided by
the world size). Each save, the sharded checkpoint's ``all_gather_object`` of slice descriptions and
``gather_object`` of file sizes; a load reads files only.

Hangs (a mismatched collective) and PyTorch's flight recorder are in :mod:`.hangs`. Taught in
notebook 11. Run it::

    python -c "from course_utils.checkpoint import failures; print(failures.crash_and_resume('ck'))"
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..launcher import RankFailedError, launch
from . import layouts, resume
from .sharded import ShardedState, latest, load, save

D = torch.float64
SAMPLES, PER_RANK = 48, 3  # 48 samples, 3 per rank and step


def net(device) -> nn.Module:
    """The model, the same on every rank and every start (seed 0); 8 -> 16 -> 2 with dropout."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 2))
    return layers.to(device, D)


def dataset(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed data set: ``(SAMPLES, 8)`` inputs and ``(SAMPLES,)`` labels, from seed 5."""
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(SAMPLES, 8, generator=g, dtype=D)  # (48, 8)
    ys = (xs[:, 0] + xs[:, 1] > 0).long()  # (48,)
    return xs.to(device), ys.to(device)


def log_event(root, rank: int, event: str, **fields) -> None:
    """Append one line to ``root/events-rank<r>.jsonl``: the event, the wall time and ``fields``."""
    line = json.dumps({"event": event, "t": time.time(), **fields})
    with open(Path(root) / f"events-rank{rank}.jsonl", "a") as f:
        f.write(line + "\n")
        f.flush()


def die(root, rank: int, step: int, how: str) -> None:
    """Rank ``rank`` dies in step ``step``: ``os._exit(1)`` (``how="exit"``) or an exception."""
    log_event(root, rank, "dies", step=step, how=how)
    print(f"rank {rank} dies in step {step} ({how})", flush=True)
    if how == "exit":
        os._exit(1)
    raise RuntimeError(f"rank {rank} failed in step {step}")


def _resume(root, model, opt, ctx) -> tuple[int, resume.DataPosition]:
    """The step and data position to start at: from the newest complete checkpoint, or 0."""
    folder = latest(root)
    if folder is None:
        return 0, resume.DataPosition(seed=3)
    layouts.init_optimizer_state(opt)
    loaded = load(folder, layouts.replicated(model, opt), rank=ctx.rank)
    step, pos = resume.restore(loaded, ctx.device, ctx.world_size)
    print(f"rank {ctx.rank}: resumed from {folder.name} at step {step}", flush=True)
    log_event(root, ctx.rank, "resumed", step=step)
    return step, pos


def _save(root, step: int, pos, model, opt, ctx) -> None:
    meta, mine = resume.capture(step, pos, ctx.device)
    folder = Path(root) / f"step-{step:08d}"
    save(ShardedState(layouts.replicated(model, opt), meta, mine), folder,
         rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
    log_event(root, ctx.rank, "saved", step=step)


def train_worker(ctx, root, steps: int = 12, every: int = 4, fail_rank: int | None = None,
                 fail_step: int | None = None, how: str = "exit") -> dict:  # fmt: skip
    """``steps`` steps of data-parallel training, a checkpoint under ``root`` after every ``every``;
    starts from the newest complete checkpoint there. Rank ``fail_rank`` dies in step
    ``fail_step`` (1-based) after its backward. Returns the losses of the steps it ran, the final
    parameters and the step it started at."""
    torch.set_num_threads(1)  # the same sums under launch and torchrun, whatever the cores
    n, r = ctx.world_size, ctx.rank
    Path(root).mkdir(parents=True, exist_ok=True)
    model = net(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs, ys = dataset(ctx.device)
    torch.manual_seed(100 + r)  # each rank its own dropout masks and noise
    log_event(root, r, "start")
    step, pos = _resume(root, model, opt, ctx)
    start, losses = step, {}
    while step < steps:
        idx = pos.batch(SAMPLES, PER_RANK, r, n)
        x = xs[idx] + 0.1 * torch.randn(len(idx), 8, dtype=D, device=ctx.device)  # (3, 8)
        loss = F.cross_entropy(model(x), ys[idx])
        opt.zero_grad()
        loss.backward()
        if r == fail_rank and step + 1 == fail_step:
            die(root, r, step + 1, how)
        for p in model.parameters():  # the gradients averaged over the ranks
            dist.all_reduce(p.grad)
            p.grad /= n
        opt.step()
        step += 1
        pos.advance(SAMPLES // (PER_RANK * n))
        losses[step] = loss.item()
        log_event(root, r, "step", step=step)
        if step % every == 0:
            _save(root, step, pos, model, opt, ctx)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"losses": losses, "params": params, "started_at": start}


@dataclass
class LostWork:
    """What one failure cost, read from the ranks' event logs (wall-clock times)."""

    failed_step: int
    """The step the rank died in (1-based); its work is lost whole."""
    resumed_from: int
    """The step of the last complete checkpoint, where the restart began."""
    steps_redone: int
    """Steps completed before the failure and done again after it: ``failed_step - 1 -
    resumed_from``."""
    seconds_lost: float
    """From the last checkpoint's commit to the death: the work thrown away."""
    restart_seconds: float
    """From the death to the restarted ranks' resumption (the failure noticed, every rank stopped,
    new processes, the process group, the load)."""
    redo_seconds: float
    """What the restarted ranks took to redo the ``steps_redone`` steps."""


def _events(root, rank: int) -> list[dict]:
    path = Path(root) / f"events-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def lost_work(root, failed_rank: int) -> LostWork:
    """The cost of the one failure logged under ``root``: rank ``failed_rank`` died once, and the
    job was started again and ran at least back to the failed step."""
    mine = _events(root, failed_rank)
    at = next(i for i, e in enumerate(mine) if e["event"] == "dies")
    death, before, after = mine[at], mine[:at], mine[at + 1 :]
    back = next((e["step"] for e in after if e["event"] == "resumed"), 0)
    committed = [e["t"] for e in before if e["event"] == "saved" and e["step"] == back]
    began = committed[-1] if committed else before[0]["t"]  # no checkpoint: all since the start
    resumed = [e["t"] for e in after if e["event"] == "resumed"]  # none: started from scratch
    restart = resumed[0] if resumed else next(e["t"] for e in after if e["event"] == "start")
    again = [e["t"] for e in after if e["event"] == "step" and e["step"] == death["step"] - 1]
    return LostWork(
        failed_step=death["step"],
        resumed_from=back,
        steps_redone=death["step"] - 1 - back,
        seconds_lost=death["t"] - began,
        restart_seconds=restart - death["t"],
        redo_seconds=again[0] - restart if again else 0.0,
    )


@dataclass
class Recovery:
    """A failed launch and the launch that resumed it."""

    error: RankFailedError
    """What the first launch raised."""
    results: list
    """The resumed launch's per-rank results (:func:`train_worker`'s)."""
    lost: LostWork


def crash_and_resume(root, world_size: int = 2, steps: int = 12, every: int = 4,
                     fail_rank: int = 1, fail_step: int = 7, how: str = "exit",
                     timeout: float = 120.0, echo: bool = False) -> Recovery:  # fmt: skip
    """Launch :func:`train_worker` with rank ``fail_rank`` dying in step ``fail_step``, catch the
    :class:`RankFailedError`, launch again (it resumes from the last complete checkpoint under
    ``root``) and measure the lost work."""
    if latest(root) is not None or list(Path(root).glob("events-rank*.jsonl")):
        raise ValueError(f"{root} holds an earlier run (it would resume it): pass an empty folder")
    job = dict(root=str(root), steps=steps, every=every)
    try:
        launch(train_worker, world_size, timeout=timeout, echo=echo,
               fail_rank=fail_rank, fail_step=fail_step, how=how, **job)  # fmt: skip
    except RankFailedError as e:
        error = e
    else:
        raise RuntimeError(f"rank {fail_rank} was meant to die in step {fail_step} and did not")
    results = launch(train_worker, world_size, timeout=timeout, echo=echo, **job).results
    return Recovery(error, results, lost_work(root, fail_rank))
