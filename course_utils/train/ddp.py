"""DDP on CIFAR-100 with the course's ResNet (the lectures' workload), AMP and the profiler schedule.

Under any launcher::

    torchrun --standalone --nproc-per-node 4 train/ddp.py --size gpu --data-dir /scratch/data
    srun --ntasks-per-node 4 --gpus-per-task 1 python train/ddp.py --job-dir runs/job-$SLURM_JOB_ID

What it does, and where notebooks teach it: :class:`~course_utils.models.SmallResNet` (01) wrapped in
torch's ``DistributedDataParallel`` (03); a ``DistributedSampler`` whose ``set_epoch`` reshuffles
every epoch the same way on every rank (03); AMP on GPUs, bfloat16 where the GPU does it natively,
else float16 with a gradient scaler (01, :mod:`course_utils.precision`); the profiler's ``wait, warmup, active`` schedule writing one trace per
rank and a TensorBoard copy (04). Rank 0 writes a checkpoint after every epoch; a second run with
the same ``--job-dir`` resumes from it. A ``STOP`` file in the job dir, or SIGUSR1 to a rank, makes
every rank checkpoint after the next step and exit 75 (``slurm_templates/requeue.sbatch`` uses it
before a time limit); the next run resumes at that batch (11).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from course_utils import dist as cdist
from course_utils import precision
from course_utils.cpus import loader_workers
from course_utils.data import DATA_ENV, load_dataset
from course_utils.models import SmallResNet
from course_utils.train import common


def arguments(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--dataset", default="cifar100", help="cifar100 (default), cifar10")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument(
        "--amp",
        choices=["auto", "on", "off"],
        default="auto",
        help="mixed precision: auto = on GPUs (bf16 where native, else fp16 + scaler), off on CPU; "
        "on = also bfloat16 autocast on CPU",
    )
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers per rank")
    return p.parse_args(argv)


def amp_setup(device: torch.device, mode: str):
    """(autocast context factory, GradScaler or None, dtype name) for ``--amp``."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return contextlib.nullcontext, None, "float32"
    amp = precision.choose(device)  # native bf16, else fp16 + GradScaler (emulated bf16 is slow)
    scaler = amp.grad_scaler() if amp.needs_scaler else None
    return amp.autocast, scaler, str(amp.dtype).removeprefix("torch.")


class DDPStrategy:
    """How the model is made data parallel, and how its state is saved and loaded.

    :mod:`course_utils.train.zero` supplies FSDP2 and ZeRO strategies with the same three methods.
    """

    name = "ddp"

    def build(self, net: nn.Module, ctx, args):
        """(the module to call, its optimizer)."""
        model = DDP(net, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        return model, opt

    def state(self, net, model, opt) -> tuple[dict, dict]:
        """(model state, optimizer state) complete on rank 0; every rank calls it."""
        return net.state_dict(), opt.state_dict()

    def load(self, net, model, opt, model_state: dict, opt_state: dict) -> None:
        net.load_state_dict(model_state)
        opt.load_state_dict(opt_state)


def main(argv=None, strategy=None) -> dict:
    args = arguments(argv)
    size = common.size_of(args)
    ctx = cdist.init(args.backend)
    try:
        result = train(ctx, args, size, strategy or DDPStrategy())
        common.barrier(ctx)  # every rank's collectives are done before the group is destroyed
        return result
    finally:
        common.close(ctx)


def _load_data(ctx, args, size):
    """(train set, test set, data folder): staged to ``--stage-to`` if asked, checked to be the
    same on every rank."""
    data_dir = args.data_dir or os.environ.get(DATA_ENV)
    if args.stage_to:
        data_dir = common.stage_locally(ctx, data_dir, args.stage_to)
    train_set = load_dataset(
        args.dataset,
        limit=size.train_samples,
        root=data_dir,
        augment=True,
        verify=not args.no_verify,
    )
    test_set = load_dataset(
        args.dataset, train=False, limit=size.test_samples, root=data_dir, verify=not args.no_verify
    )
    common.same_data_everywhere(ctx, train_set)
    cdist.print0(f"data: {train_set!r}")
    return train_set, test_set, data_dir


def _train_loader(ctx, args, size, train_set):
    """(loader, its ``DistributedSampler``, per-rank batch size, pin memory): each rank loads
    its ``1 / world_size`` share of every global batch."""
    if size.batch_size % ctx.world_size:
        raise SystemExit(
            f"the global batch {size.batch_size} of size '{size.name}' does not split over "
            f"{ctx.world_size} ranks: pick a world size that divides it"
        )
    per_rank = size.batch_size // ctx.world_size
    # the preset's workers, but no more than this rank's share of the usable cores leaves
    workers = (
        loader_workers(size.num_workers, ctx.local_world_size)
        if args.workers is None
        else args.workers
    )
    sampler = DistributedSampler(
        train_set.dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=args.seed
    )
    pin = ctx.device.type == "cuda"
    loader = DataLoader(
        train_set.dataset,
        batch_size=per_rank,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
    )
    return loader, sampler, per_rank, pin


def _resume(ctx, folder, strategy, net, model, opt, scaler) -> dict:
    """Where to start, from the job's checkpoint, whose states are loaded into the model,
    optimizer and scaler: ``epoch``, ``batch`` (batches of that epoch already trained: more than
    0 after a stop on request), ``step``, ``losses``, and ``rng``, the random states still to be
    restored (by :func:`_batches`, once the epoch's first ``batch`` batches are skipped). Epoch 0,
    batch 0 without a checkpoint."""
    state = common.load_checkpoint(folder, ctx.device)
    if state is None:
        return {"epoch": 0, "batch": 0, "step": 0, "losses": [], "rng": None}
    if state.get("strategy", "ddp") != strategy.name:
        raise SystemExit(
            f"{folder / common.CHECKPOINT} was written by the {state['strategy']} script, not "
            f"{strategy.name}: give this job its own --job-dir"
        )
    strategy.load(net, model, opt, state["model"], state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    start = {k: state.get(k, 0) for k in ("epoch", "batch", "step")}
    start.update(losses=list(state["losses"]), rng=state.get("rng"))
    if not start["batch"]:  # at an epoch's end: the next epoch's shuffle draws from these states
        common.restore_rng(ctx, start.pop("rng"))
        start["rng"] = None
    cdist.print0(
        f"resumed from {folder / common.CHECKPOINT}: epoch {start['epoch']}, batch "
        f"{start['batch']} of it, step {start['step']}"
    )
    return start


def _batches(ctx, loader, skip: int, rng):
    """The epoch's batches after the first ``skip``, which are loaded and dropped (augmentations
    in the main process draw random numbers in the same order as in the stopped run); then the
    random states saved at the stop are put back."""
    batches = iter(loader)
    for _ in range(skip):
        next(batches)
    common.restore_rng(ctx, rng)
    return batches


def _train_step(ctx, model, opt, autocast, scaler, x, y, pin: bool) -> torch.Tensor:
    """One optimizer step on this rank's batch, through the gradient scaler when there is one;
    return this rank's loss (the strategy's model communicates inside forward and backward)."""
    x = x.to(ctx.device, non_blocking=pin)
    y = y.to(ctx.device, non_blocking=pin)
    with autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    return loss


def _save(ctx, folder, strategy, net, model, opt, scaler, epoch, batch, step, losses) -> None:
    """Checkpoint everything a later run with this ``--job-dir`` resumes from: it continues at
    batch ``batch`` of ``epoch`` (batch 0 after an epoch's end)."""
    model_state, opt_state = strategy.state(net, model, opt)
    common.save_checkpoint(
        ctx,
        folder,
        {
            "strategy": strategy.name,
            "model": model_state,
            "optimizer": opt_state,
            "scaler": scaler.state_dict() if scaler is not None else {},
            "epoch": epoch,
            "batch": batch,
            "step": step,
            "losses": losses,
            "rng": common.gather_rng(ctx),  # augmentation and shuffles continue exactly
        },
    )


def train(ctx, args, size, strategy) -> dict:
    """Train, checkpoint every epoch, evaluate; return (and write) the run's result.

    After every step, :class:`~course_utils.train.common.StopRequest` asks all ranks whether a
    stop was requested; if so they checkpoint there and return ``{"stopped": True, ...}`` without
    evaluating (the script then exits with ``common.STOPPED``)."""
    folder = common.job_dir(ctx, args)
    train_set, test_set, data_dir = _load_data(ctx, args, size)
    loader, sampler, per_rank, pin = _train_loader(ctx, args, size, train_set)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts)
    net = SmallResNet(
        num_classes=train_set.num_classes, width=size.width, in_channels=train_set.shape[0]
    ).to(ctx.device)
    model, opt = strategy.build(net, ctx, args)
    autocast, scaler, amp_dtype = amp_setup(ctx.device, args.amp)
    epochs = args.epochs or size.epochs
    start = _resume(ctx, folder, strategy, net, model, opt, scaler)
    step, losses, stopped = start["step"], start["losses"], False
    save = functools.partial(_save, ctx, folder, strategy, net, model, opt, scaler)

    metrics = common.Metrics(ctx, folder, after_step=step)
    total = epochs * len(loader)
    t0 = time.perf_counter()
    stop = common.StopRequest(ctx, folder)
    with stop, common.Profiler(ctx, folder, common.profile_config(args.profile)) as prof:
        for epoch in range(start["epoch"], epochs):
            sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            done = start["batch"] if epoch == start["epoch"] else 0
            for x, y in _batches(ctx, loader, done, start["rng"] if done else None):
                loss = _train_step(ctx, model, opt, autocast, scaler, x, y, pin)
                step, done = step + 1, done + 1
                losses.append(common.global_mean(loss, ctx))
                metrics.log(step=step, epoch=epoch, loss=losses[-1])
                prof.step()
                ctx.step(total=total)
                if stop.requested():  # every rank agrees, so every rank stops here
                    save(epoch, done, step, losses)
                    stop.served()
                    stopped = True
                    break
                if args.max_steps and step >= args.max_steps:
                    break
            if stopped:
                cdist.print0(f"stopped on request after step {step}: checkpoint written")
                break
            save(epoch + 1, 0, step, losses)
            cdist.print0(f"epoch {epoch}: step {step}, loss {losses[-1]:.4f}")
            if args.max_steps and step >= args.max_steps:
                break
    metrics.close()
    if stopped:
        return {"script": strategy.name, "stopped": True, "steps": step, "folder": str(folder)}
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)  # the last step's kernels are part of the time
    seconds = time.perf_counter() - t0
    accuracy = evaluate(model, test_set.dataset, per_rank, ctx)
    traces = common.gather(prof.trace)
    result = {
        **_about(ctx, strategy, size, train_set, data_dir, amp_dtype),
        "start_epoch": start["epoch"],
        "start_step": start["step"],
        "epochs": epochs,
        "steps": step,
        "losses": losses,
        "test_accuracy": accuracy,
        "seconds": seconds,
        "traces": [t for t in traces if t],
        "checkpoint": str(folder / common.CHECKPOINT),
    }
    common.write_result(ctx, folder, result)
    cdist.print0(
        f"done: {ctx.world_size} ranks, {step} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"test accuracy {accuracy:.3f}; wrote {folder}"
    )
    return result


def _about(ctx, strategy, size, train_set, data_dir, amp_dtype) -> dict:
    """What ran where, for ``result.json`` (gathers every rank's host: a collective)."""
    return {
        "script": strategy.name,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "source": ctx.extras.get("source"),
        "ranks": common.gather_where(ctx),
        "size": size.name,
        "data": repr(train_set),
        "data_dir": str(data_dir) if data_dir else None,
        "synthetic": train_set.synthetic,
        "amp": amp_dtype,
    }


@torch.no_grad()
def evaluate(model, dataset, batch: int, ctx) -> float:
    """Accuracy on the test set, each rank scoring its own share and the counts summed.

    Every rank scores the same number of images (the last ``len % world_size`` are left out): with
    FSDP2 every forward is a collective, so ranks with one batch more would wait forever."""
    import torch.distributed as dist

    model.eval()
    even = len(dataset) - len(dataset) % ctx.world_size
    mine = Subset(dataset, range(ctx.rank, even, ctx.world_size))  # each image once
    counts = torch.zeros(2, device=ctx.device)
    for x, y in DataLoader(mine, batch_size=batch):
        pred = model(x.to(ctx.device)).argmax(1)
        counts[0] += (pred == y.to(ctx.device)).sum()
        counts[1] += y.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


if __name__ == "__main__":
    common.exit_now(main(sys.argv[1:]))
