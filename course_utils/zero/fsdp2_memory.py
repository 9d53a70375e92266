"""What FSDP2 (``torch.distributed.fsdp.fully_shard``) holds unsharded at a given moment.

Notebook 08 compares FSDP2's peak parameter memory with the formula ``Σψ/n + root + k·max ψᵢ``:
``k = 1`` when one unit is gathered at a time, ``k = 2`` when a unit is prefetched while the
current one computes (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``;
on GPUs FSDP2 also overlaps its all-gathers with compute on a stream of their own). FSDP2 keeps, per ``fully_shard`` module, an ``FSDPParamGroup`` whose
``FSDPParam`` objects own the unsharded parameters' storage (``all_gather_outputs``, resized to zero
bytes when resharded), and a pending all-gather's flat output (``_all_gather_result``) while a
prefetched unit waits to be copied out. These are private attributes of torch's FSDP2: when a
version lacks them, :func:`unsharded_bytes` returns ``None`` and the notebook says so.
"""

from __future__ import annotations

from torch import nn


def _groups(model: nn.Module):
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is None:
            continue
        group = getattr(state(), "_fsdp_param_group", None)
        if group is not None:
            yield group


def unsharded_bytes(model: nn.Module) -> int | None:
    """Bytes of unsharded parameters FSDP2 holds now (each storage once), or ``None`` when this
    torch's FSDP2 keeps them elsewhere."""
    seen, total, found = set(), 0, False
    for group in _groups(model):
        params = getattr(group, "fsdp_params", None)
        if params is None:
            return None
        found = True
        tensors = [t for fp in params for t in getattr(fp, "all_gather_outputs", [])]
        pending = getattr(group, "_all_gather_result", None)
        if pending is not None and hasattr(pending, "all_gather_output"):
            tensors.append(pending.all_gather_output)  # a prefetched unit, not copied out yet
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total if found else None


def sharded_bytes(model: nn.Module) -> int:
    """Bytes of this rank's shards of the model's parameters (DTensors' local parts)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


__all__ = ["sharded_bytes", "unsharded_bytes"]
