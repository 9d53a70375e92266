"""Importable workers for the tests (the by-value path is tested separately)."""

from __future__ import annotations

import torch


def dtensor_sum(ctx, seed: int = 0) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch < 2.4 kept DTensor under _tensor
        from torch.distributed._tensor import Shard, distribute_tensor

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch.manual_seed(seed)
    full = torch.randn(8, 4).to(ctx.device)
    d = distribute_tensor(full, mesh, [Shard(0)])
    return float((d * 2).full_tensor().sum())
