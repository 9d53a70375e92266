"""Notebook 07's DP x PP x TP training of its GPT as a script, checked against one process.

    torchrun --nnodes 2 --nproc-per-node 4 ... train/threed.py --dp 2 --pp 2 --tp 2
    srun --ntasks-per-node 2 python train/threed.py --dp 2 --tp 2 --check

It runs :func:`course_utils.parallel3d.compose_worker`, the worker notebook 07 runs: the course's
tensor parallel layers over each TP group (TP innermost, so a TP group is on one node), the 1F1B
schedule over each PP group and gradient averaging (or ZeRO-1) over each DP group. With ``--check``
every rank also trains one float64 copy of the whole model on the whole batch and the script
fails unless every parameter shard equals its slice of that copy (a difference under 1e-9).

The batches are random tokens: this is a test of the composition, not a language model, so the
loss is compared with one process, not expected to fall. It writes no checkpoint (the
single-process reference is the point); ``train/ddp.py`` and ``train/zero.py`` do.
"""

from __future__ import annotations

import sys

import torch

from course_utils import dist as cdist
from course_utils.measure import worst as measure_worst
from course_utils.models import GPTConfig
from course_utils.parallel3d import DP_METHODS, compose_worker
from course_utils.train import common

CONFIGS = {
    "ci": GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4),
    "cpu": GPTConfig(vocab=256, seq_len=64, d_model=128, n_heads=8, n_layers=8),
    "gpu": GPTConfig(vocab=8192, seq_len=512, d_model=1024, n_heads=16, n_layers=16),
}
"""The GPT trained at each size (notebook 07 uses the ``ci`` one)."""

TOLERANCE = 1e-9


def arguments(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=None, help="default: world size / (pp x tp)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--dp-method", default="ddp", choices=list(DP_METHODS))
    p.add_argument(
        "--check", action="store_true", help="float64, and compare every shard with one process"
    )
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = arguments(argv)
    size = common.size_of(args)
    ctx = cdist.init(args.backend)
    try:
        folder = common.job_dir(ctx, args)
        if ctx.world_size % (args.pp * args.tp):
            raise SystemExit(
                f"pp={args.pp} x tp={args.tp} does not divide the world size {ctx.world_size}"
            )
        dp = args.dp or ctx.world_size // (args.pp * args.tp)
        out = compose_worker(
            ctx,
            dp,
            args.pp,
            args.tp,
            cfg=CONFIGS[size.name] if size.name in CONFIGS else CONFIGS["ci"],
            global_batch=args.global_batch,
            micro_batches=args.micro_batches,
            steps=args.steps,
            dtype=torch.float64 if args.check else torch.float32,
            schedule=args.schedule,
            dp_method=args.dp_method,
            reference=args.check,
            seed=args.seed,
        )
        mine = {**out, **common.where(ctx)}
        everyone = common.gather(mine)
        worst = measure_worst(d for r in everyone for d in r["diffs"])  # NaN if any is NaN
        worst_loss = measure_worst(d for r in everyone for d in r["loss_diffs"])
        result = {
            "script": "threed",
            "world_size": ctx.world_size,
            "dims": {"dp": dp, "pp": args.pp, "tp": args.tp},
            "backend": ctx.backend,
            "source": ctx.extras.get("source"),
            "ranks": everyone,
            "checked": args.check,
            "max_param_diff": worst,
            "max_loss_diff": worst_loss,
            "step_s": out["step_s"],
        }
        common.write_result(ctx, folder, result)
        if args.check:
            cdist.print0(
                f"dp={dp} x pp={args.pp} x tp={args.tp} on {ctx.world_size} ranks: largest difference "
                f"from one process {worst:.1e} (parameters), {worst_loss:.1e} (loss)"
            )
            if not (worst <= TOLERANCE and worst_loss <= TOLERANCE):  # NaN fails too
                raise SystemExit(
                    f"the 3D run differs from one process by {max(worst, worst_loss):.1e} "
                    f"(tolerance {TOLERANCE:.0e}): see {folder / 'result.json'}"
                )
        common.barrier(ctx)
        return result
    finally:
        common.close(ctx)


if __name__ == "__main__":
    main(sys.argv[1:])
    common.exit_now()
