"""A rank dies once under ``torchrun --max-restarts 1``; torchrun restarts every rank, and they
resume from the last complete checkpoint. Taught in notebook 11.

The training is :func:`.failures.train_worker`, as under ``launch``. Rank ``--fail-rank`` dies in
step ``--fail-step`` on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0 there, 1 after
the restart). Torchrun's agent sees the dead worker, stops the others (SIGTERM), and starts the
whole group again: a new rendezvous, new processes, the same ranks. Each rank writes its result to
``<root>/final-rank<r>.pt``. Run it (``LOGLEVEL=INFO`` shows the agent's restart)::

    LOGLEVEL=INFO OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
        python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        -m course_utils.checkpoint.elastic_demo --root /tmp/ck

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default the ranks' ``init_process_group`` uses the
rendezvous' own TCPStore, the same one (and port: each rank prints it) at every attempt, with the
first attempt's keys still in it. On torch 2.14.1 (2 cores, gloo), 7 of 14 such restarts went
through; 4 hung in gloo's ``connectFullMesh`` and 3 failed with "Connection refused" to a port of
the first attempt, as in pytorch/pytorch#135712. With the variable set, each attempt gets a store
of its own: 8 of 8 went through.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from .. import dist as cdist
from .failures import train_worker


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="the checkpoints' folder")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="save after every this many steps")
    p.add_argument("--fail-rank", type=int, default=1, help="-1: no rank dies")
    p.add_argument("--fail-step", type=int, default=7)
    p.add_argument("--how", choices=("exit", "raise"), default="exit")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fail_rank = args.fail_rank if attempt == 0 and args.fail_rank >= 0 else None
    with cdist.session(backend="gloo") as ctx:
        print(
            f"rank {ctx.rank}: attempt {attempt}, store {os.environ.get('MASTER_PORT')}", flush=True
        )
        out = train_worker(ctx, args.root, args.steps, args.every, fail_rank, args.fail_step,
                           args.how)  # fmt: skip
        torch.save({**out, "attempt": attempt}, Path(args.root) / f"final-rank{ctx.rank}.pt")


if __name__ == "__main__":
    main()
