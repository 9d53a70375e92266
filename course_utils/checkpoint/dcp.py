"""The same with ``torch.distributed.checkpoint`` (DCP): sharded, resharding, and asynchronous.

``get_state_dict(model, optimizer)`` gives the model's and optimizer's state under their
single-device names, whatever the layout (DDP, FSDP2's DTensors, TP's DTensors); ``dcp.save``
has every rank write its own ``__<r>_0.distcp`` file and rank 0 the ``.metadata`` (DCP's index,
written last: a folder without it is not a checkpoint). Loading plans, from the metadata, which
pieces each rank reads: a checkpoint loads under another layout or number of ranks. Tensors that
several ranks hold under the same name and offsets (replicated ones) are written once: DCP
deduplicates them while planning.

**Asynchronous saves** (:func:`async_save`): the state is copied to host memory (staged), the call
returns, and a background thread writes the files while training goes on. The background save runs
collectives of its own (planning, the metadata's gather), so it needs **its own process group**
(:func:`checkpoint_group`): on torch 2.14.1 with gloo, an async save on the default group while
the training loop all-reduces on it hung here (the two threads' collectives interleave on one
group). The caller must wait on the returned future before the next save, and before the process
exits: ``dcp.async_save`` does not order successive calls itself (PyTorch recommends one
asynchronous save in flight at a time). The writer is a thread of the training process: the write
leaves the critical path, not the machine (it competes with the training steps it overlaps).

On torch 2.6 ``async_save`` asserts that the group it uses has a CPU backend ("A CPU backend must
be enabled for async save; try initializing process group with 'cpu:gloo,cuda:nccl'"), moves the
state to CPU and writes it from a thread. Tensors already on the CPU it does not copy (``.to("cpu")``
returns them): the thread wrote the parameters as training changed them after the call (a test
on torch 2.6 caught it). Torch versions without ``staging.DefaultStager`` get the copy made here.

``dcp.load`` fills the tensors of the state dict it is given in place; with the default
``StateDictOptions`` those are the model's parameters and the optimizer's state themselves, so
``set_state_dict`` copies nothing new here. It matters with ``full_state_dict=True`` or
``cpu_offload=True``, where ``get_state_dict`` hands back copies: kept, so the code stays right.

Unlike :func:`.sharded.save`, DCP writes in place: a crash mid-save leaves the folder without
``.metadata`` (unloadable, not half-loaded); save each checkpoint to a fresh folder.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import staging
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_map


def state_dict(model, optimizer=None) -> dict:
    """``{"model": ..., "optim": ...}`` under single-device names (DTensors stay sharded)."""
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save(model, optimizer, folder, *, extra: dict | None = None, process_group=None) -> Path:
    """Every rank writes its part of ``model``'s and ``optimizer``'s state (and ``extra``: the
    step, a data position) to ``folder``; returns when all is written."""
    dcp.save({**state_dict(model, optimizer), **(extra or {})}, checkpoint_id=str(folder),
             process_group=process_group)  # fmt: skip
    return Path(folder)


def checkpoint_group():
    """A gloo process group over all ranks for background saves (call it on every rank, once)."""
    return dist.new_group(backend="gloo")


def async_save(model, optimizer, folder, *, process_group, extra: dict | None = None):
    """Start saving; returns a future once the state is staged, so training may change the
    parameters at once. ``process_group``: not the training loop's (:func:`checkpoint_group`)."""
    if process_group is None:
        raise ValueError(
            "async_save needs its own process group (checkpoint_group()): the background save's "
            "collectives would interleave with the training loop's on the default one and hang"
        )
    state = {**state_dict(model, optimizer), **(extra or {})}
    if not hasattr(staging, "DefaultStager"):  # torch 2.6: CPU tensors would be written live
        state = tree_map(_cpu_copy, state)
    return dcp.async_save(state, checkpoint_id=str(folder), process_group=process_group)


def _cpu_copy(x):
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return x.detach().clone()
    return x


def load(model, optimizer, folder, *, extra: dict | None = None) -> dict:
    """Fill ``model`` and ``optimizer`` (any layout, any number of ranks) from ``folder``.

    ``extra``: the non-model entries to read, with their default values (filled in and returned)."""
    state = {**state_dict(model, optimizer), **(extra or {})}
    dcp.load(state, checkpoint_id=str(folder))
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
    return {k: state[k] for k in (extra or {})}


def steps_to_outlast_a_save(save, step, device, *, at_least: int = 3, at_most: int = 50) -> int:
    """How many training steps last twice one synchronous ``save()``: enough for an asynchronous
    save's write to finish behind them, so that its stall shows what overlap hides rather than a
    wait. Times one ``save()`` and one ``step()``; every rank takes the largest count."""
    t0 = time.perf_counter()
    save()
    saving = time.perf_counter() - t0
    t0 = time.perf_counter()
    step()
    one = time.perf_counter() - t0
    k = torch.tensor([min(at_most, max(at_least, math.ceil(2 * saving / max(one, 1e-9))))],
                     device=device)  # fmt: skip
    if dist.is_initialized():
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
    return int(k.item())
