"""Every way to shard data-parallel training, run on the same model and checked against one process.

:func:`wrap` applies one of :data:`METHODS` to a model and its optimizer (:mod:`.parity` checks
each against one process), and :func:`states_and_allocator` counts a method's bytes after a step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import models
from ..measure import allocated_memory, synchronize
from .memory import count_model_states
from .stage1 import ShardedOptimizer
from .stage2 import ShardedGradientOptimizer
from .stage3 import ShardedModel

METHODS = ("ddp", "zero1", "zero1-naive", "zero2", "zero3", "zero-redundancy", "fsdp2")
"""``ddp``: torch DDP (stage 0); ``zero1``..``zero3``: this package (``zero1-naive``: all-reduce,
then all-gather); ``zero-redundancy``: DDP with torch's ``ZeroRedundancyOptimizer``; ``fsdp2``:
``torch.distributed.fsdp.fully_shard`` on every linear layer, then on the model."""

MODELS = {"mlp": models.ToyMLP, "tied": models.TiedMLP, "frozen": models.FrozenMLP}
OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def cpu_or_device_mesh(device: torch.device):
    """A one-dimensional mesh over all ranks on ``device``'s type. On CPU it must be given
    explicitly: a default mesh picks the accelerator where there is one (pytorch issue 132471)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def wrap(method: str, model: nn.Module, optimizer: str, device: torch.device, units=None):
    """(model to call, optimizer, how to read its full parameters) for ``method``: one of
    :data:`METHODS`, or a function ``method(model, optimizer_class, options)`` returning the same
    three (a notebook's own implementation)."""
    cls, options = OPTIMIZERS[optimizer]
    if callable(method):
        return method(model, cls, options)
    if method == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, cls(ddp.parameters(), **options), lambda: dict(model.named_parameters())
    if method in ("zero1", "zero1-naive", "zero2"):
        if method == "zero2":
            opt = ShardedGradientOptimizer(model.parameters(), cls, **options)
        else:
            how = "all_reduce" if method == "zero1-naive" else "reduce_scatter"
            opt = ShardedOptimizer(model.parameters(), cls, gradient_reduction=how, **options)
        return model, opt, lambda: dict(model.named_parameters())
    if method == "zero3":
        sharded = ShardedModel(model, units=units)
        return sharded, cls(sharded.parameters(), **options), sharded.full_parameters
    if method == "zero-redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, **options)
        return ddp, opt, lambda: dict(model.named_parameters())
    if method == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from ..compat import fsdp2_unsupported

        why = fsdp2_unsupported(torch.device(device).type)
        if why:
            raise RuntimeError(why)
        mesh = cpu_or_device_mesh(device)
        for m in (
            units if units is not None else [m for m in model.modules() if isinstance(m, nn.Linear)]
        ):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = cls(model.parameters(), **options)

        def full():
            return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                    for k, v in model.named_parameters()}  # fmt: skip

        return model, opt, full
    raise ValueError(f"method must be one of {METHODS}, not {method!r}")


def states_and_allocator(
    ctx, method: str, model: str = "mlp", optimizer: str = "adam", dtype=torch.float64
) -> dict:
    """One training step with ``method`` and no reference model beside it: the model-state bytes
    counted (:func:`~.memory.count_model_states`) and, on a GPU, what the CUDA allocator holds for
    this rank's training at the same moment (``memory_allocated`` now minus before the model
    existed; ``None`` on the CPU). The allocator's number adds what else the method keeps on the
    device: the batch, communication buffers (torch DDP's gradient buckets, a second copy of the
    gradients unless ``gradient_as_bucket_view=True``) and 512-byte rounding. Notebook 08 prints
    both."""
    import gc

    n, r = dist.get_world_size(), dist.get_rank()
    gc.collect()  # a previous method's wrappers hold reference cycles (hooks): free them first
    synchronize(ctx.device)
    before = allocated_memory(ctx.device)
    torch.manual_seed(0)
    net = MODELS[model]().to(ctx.device, dtype)
    call, opt, _ = wrap(method, net, optimizer, ctx.device)
    x = torch.randn(16, 16, dtype=dtype, device=ctx.device)
    y = torch.randint(4, (16,), device=ctx.device)
    nn.functional.cross_entropy(call(x.chunk(n)[r]), y.chunk(n)[r]).backward()
    getattr(call, "finish_gradient_synchronization", lambda: None)()
    opt.step()
    states = count_model_states(call, opt)
    now = allocated_memory(ctx.device)
    return {"counted": states.total, "allocator": None if before is None else now - before}
