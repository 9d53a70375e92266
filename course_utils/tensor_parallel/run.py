"""torch's DTensor tensor parallelism on the course's GPT, and how to compare its shards.

:func:`torch_tp` shards a GPT with ``parallelize_module`` and :func:`torch_gpt_plan` (torchtitan's
styles, the same shards as :func:`~.apply.gpt_plan`); :func:`shard_like` finds a shard's slice of a
full tensor from the shapes alone (shards are contiguous and in rank order). The parity worker,
which trains a sharded model beside one process, is in :mod:`.parity`:

    from course_utils import launch
    from course_utils.tensor_parallel.parity import gpt_parity
    res = launch(gpt_parity, world_size=2)       # from scratch, float64
    res.results[0]["params"]                      # max |difference| after the steps
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models import GPT


def shard_like(full: torch.Tensor, local: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` with ``local``'s shape (``full`` if they agree)."""
    if full.shape == local.shape:
        return full
    dims = [d for d, (a, b) in enumerate(zip(full.shape, local.shape)) if a != b]
    if len(dims) != 1 or full.dim() != local.dim():
        raise ValueError(f"cannot find {tuple(local.shape)} as a slice of {tuple(full.shape)}")
    d = dims[0]
    n = full.shape[d] // local.shape[d]
    return full.chunk(n, d)[dist.get_rank(group) % n]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard, or the tensor


def _grad_local(p) -> torch.Tensor:
    """This rank's gradient shard. A DTensor parameter run on sequence shards (a LayerNorm under
    ``SequenceParallel``) holds a pending sum (``Partial``): DTensor reduces it when asked."""
    g = p.grad
    if hasattr(g, "redistribute"):
        g = g.redistribute(g.device_mesh, p.placements)
    return _local(g)


def settle_partial_grads(model) -> None:
    """Sum the pending (``Partial``) gradients of DTensor parameters before the optimizer step.

    A LayerNorm under ``SequenceParallel`` sees only this rank's positions, so its weight's
    gradient is a DTensor with a pending sum over the ranks. torch 2.14's optimizers sum it when
    they combine it with the replicated weight; torch 2.6's SGD applied each rank's partial sum, and
    the ranks' copies drifted apart (seen in this course's floor test). Doing it here is right on
    both.
    """
    for p in model.parameters():
        g = p.grad
        if hasattr(g, "redistribute") and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def torch_gpt_plan(model: GPT, sequence_parallel: bool = False) -> dict:
    """:func:`gpt_plan` in torch's ``torch.distributed.tensor.parallel`` styles, as torchtitan
    writes it: same shards, DTensor placements instead of hand-written collectives."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {"embed": RowwiseParallel(input_layouts=Replicate())}  # vocab-parallel embedding
    if not sequence_parallel:
        for i in range(len(model.blocks)):
            plan |= {
                f"blocks.{i}.attn.qkv": ColwiseParallel(),
                f"blocks.{i}.attn.proj": RowwiseParallel(),
                f"blocks.{i}.mlp.up": ColwiseParallel(),
                f"blocks.{i}.mlp.down": RowwiseParallel(),
            }
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return plan
    plan["blocks.0"] = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.ln1": SequenceParallel(),
            f"blocks.{i}.attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.ln2": SequenceParallel(),
            f"blocks.{i}.mlp.up": ColwiseParallel(input_layouts=Shard(1)),
            f"blocks.{i}.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    plan["ln_f"] = SequenceParallel()
    plan["head"] = ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    )
    return plan


def torch_tp(model: GPT, sequence_parallel: bool = False, device=None):
    """Shard ``model`` with torch's ``parallelize_module`` on a 1-D mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    device = torch.device(device or next(model.parameters()).device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, torch_gpt_plan(model, sequence_parallel))


__all__ = [
    "settle_partial_grads",
    "shard_like",
    "torch_gpt_plan",
    "torch_tp",
]
