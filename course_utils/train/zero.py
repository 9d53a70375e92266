"""The DDP workload with sharded data parallelism: FSDP2 (``fully_shard``) or the course's ZeRO.

    torchrun --standalone --nproc-per-node 4 train/zero.py --method fsdp2 --size gpu
    srun --ntasks-per-node 4 --gpus-per-task 1 python train/zero.py --method zero2

The training loop, data, AMP, profiler, checkpoints and job directory are :mod:`.ddp`'s; only the
way the model is sharded and its state saved differs (notebook 08):

- ``fsdp2``: torch's ``fully_shard`` on every residual block, the stem, the classifier and the
  whole model (parameters, gradients and optimizer state sharded: ZeRO-3). The checkpoint is the
  full, unsharded state, assembled with ``torch.distributed.checkpoint.state_dict`` and written by
  rank 0, so it loads on any number of ranks;
- ``zero1`` / ``zero2``: :class:`~course_utils.zero.ShardedOptimizer` /
  :class:`~course_utils.zero.ShardedGradientOptimizer` (optimizer state, and gradients, sharded).
  The optimizer state is consolidated on rank 0 before it is saved. BatchNorm's running statistics
  are each rank's own (nothing broadcasts them, unlike DDP); rank 0's are saved.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from course_utils.compat import fsdp2_unsupported
from course_utils.train import common, ddp
from course_utils.zero import ShardedGradientOptimizer, ShardedOptimizer
from course_utils.zero.run import cpu_or_device_mesh

METHODS = ("fsdp2", "zero1", "zero2")


def _sgd(args) -> dict:
    return {"lr": args.lr, "momentum": 0.9, "weight_decay": 5e-4}


class FSDP2Strategy(ddp.DDPStrategy):
    name = "fsdp2"

    def build(self, net, ctx, args):
        from torch.distributed.fsdp import fully_shard

        why = fsdp2_unsupported(ctx.device.type)
        if why:
            raise SystemExit(f"--method fsdp2: {why}. Use --method zero2 here.")
        mesh = cpu_or_device_mesh(ctx.device)
        for unit in [net.stem, *net.layers, net.fc]:
            fully_shard(unit, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, torch.optim.SGD(net.parameters(), **_sgd(args))

    def state(self, net, model, opt):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(model, opt, options=options)

    def load(self, net, model, opt, model_state, opt_state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            model,
            opt,
            model_state_dict=model_state,
            optim_state_dict=opt_state,
            options=StateDictOptions(full_state_dict=True),
        )


class ZeroStrategy(ddp.DDPStrategy):
    def __init__(self, stage: int):
        self.stage, self.name = stage, f"zero{stage}"

    def build(self, net, ctx, args):
        cls = ShardedGradientOptimizer if self.stage == 2 else ShardedOptimizer
        return net, cls(net.parameters(), torch.optim.SGD, **_sgd(args))

    def state(self, net, model, opt):
        opt.consolidate_state_dict(to=0)
        return net.state_dict(), (opt.state_dict() if torch.distributed.get_rank() == 0 else {})


def strategy(method: str) -> ddp.DDPStrategy:
    if method == "fsdp2":
        return FSDP2Strategy()
    if method in ("zero1", "zero2"):
        return ZeroStrategy(int(method[-1]))
    raise SystemExit(f"--method must be one of {', '.join(METHODS)}, not {method!r}")


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    method = "fsdp2"
    if "--method" in argv:
        i = argv.index("--method")
        if i + 1 >= len(argv):
            raise SystemExit(f"--method needs a value: one of {', '.join(METHODS)}")
        method = argv.pop(i + 1)
        argv.pop(i)
    return ddp.main(argv, strategy(method))


if __name__ == "__main__":
    common.exit_now(main(sys.argv[1:]))


__all__ = ["METHODS", "main", "nn"]
