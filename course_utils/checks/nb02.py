"""Checks for notebook 02 (DataParallel): the step by hand, and the same step without the gather.

Both run the student's step on float64 models whose forward calls are watched through a forward
hook (deep copies carry it to the replicas): which module ran, in which thread, on how many
samples. The gradients left on the original model must be one device's on the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..models import FrozenMLP, TiedMLP, ToyMLP, UnusedParamMLP
from .common import fail, passed, refuse_copies

CASES = [
    # label, model, global batch, k
    ("an MLP, 24 samples on 3 replicas", ToyMLP, 24, 3),
    ("an MLP, 10 samples on 4 replicas (chunks of 3, 3, 3, 1)", ToyMLP, 10, 4),
    ("an MLP, 2 samples on 4 replicas (chunk makes only 2 chunks)", ToyMLP, 2, 4),
    ("a model with a frozen layer", FrozenMLP, 12, 3),
    ("a model with a layer forward never uses", UnusedParamMLP, 12, 3),
    ("a model that uses one layer twice", TiedMLP, 16, 2),
]


class _Watch:
    """Forward calls of a model and of its deep copies: (module id, thread id, batch size)."""

    def __init__(self, model: nn.Module):
        calls: list[tuple[int, int, int]] = []
        lock = threading.Lock()

        def hook(module, args, out):  # a plain function: deepcopy shares it, replicas call it
            with lock:
                calls.append((id(module), threading.get_ident(), args[0].shape[0]))

        self.calls = calls
        model.register_forward_hook(hook)


@contextlib.contextmanager
def _no_data_parallel(number: str):
    """``nn.DataParallel`` refuses while the student's step runs (on the CPU it is a plain call)."""

    def refuse(*args, **kwargs):
        fail(number, "write the step yourself: nn.DataParallel is what this exercise rebuilds")

    saved = nn.DataParallel.__init__
    nn.DataParallel.__init__ = refuse
    try:
        yield
    finally:
        nn.DataParallel.__init__ = saved


class _NoGatheredLoss(TorchFunctionMode):
    """Fail when a loss is computed on more samples than one replica's chunk (a gather)."""

    def __init__(self, number: str, biggest: int):
        super().__init__()
        self.number, self.biggest = number, biggest

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.functional.cross_entropy and args and args[0].shape[0] > self.biggest:
            fail(self.number, "the loss was computed on gathered outputs: compute each replica's "
                 "loss on its own chunk, where its outputs are")  # fmt: skip
        return func(*args, **(kwargs or {}))


def _one_device(make, x, y):
    torch.manual_seed(0)
    model = make().double()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _run(number: str, step, make, batch: int, k: int, no_gather: bool):
    torch.manual_seed(0)
    model = make().double()
    g = torch.Generator().manual_seed(batch * 7 + k)
    x = torch.randn(batch, 16, generator=g, dtype=torch.float64)
    y = torch.randint(4, (batch,), generator=g)
    watch = _Watch(model)
    chunks = len(x.chunk(k))
    biggest = x.chunk(k)[0].shape[0]
    mode = _NoGatheredLoss(number, biggest) if no_gather else contextlib.nullcontext()
    with _no_data_parallel(number), mode:
        loss = step(model, x, y, k)
    return model, x, y, watch, chunks, biggest, loss


def _check(number: str, step, no_gather: bool) -> None:
    for label, make, batch, k in CASES:
        model, x, y, watch, chunks, biggest, loss = _run(number, step, make, batch, k, no_gather)
        modules = {m for m, _, _ in watch.calls}
        threads = {t for _, t, _ in watch.calls}
        sizes = sorted(s for _, _, s in watch.calls)
        where = f"for {label}"
        if not watch.calls:
            fail(number, f"{where}, no replica ran forward: copy the model, run each copy")
        if max(sizes) > biggest or sum(sizes) != batch:
            fail(number, f"{where}, forward ran on batches of {sizes}: scatter the batch with "
                 f"x.chunk(k) ({chunks} chunks here) and run each replica on its own chunk")  # fmt: skip
        if len(modules) != chunks:
            fail(number, f"{where}, {len(modules)} module(s) ran forward for {chunks} chunks: "
                 "one replica (a copy of the model) per chunk")  # fmt: skip
        if chunks > 1 and threads <= {threading.get_ident()}:
            fail(number, f"{where}, every replica ran one after the other in this thread: "
                 "parallel_apply runs each in a thread of its own (a ThreadPoolExecutor)")  # fmt: skip
        want_loss, want = _one_device(make, x, y)
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            fail(number, f"{where}, return the loss of the whole batch (a scalar tensor)")
        for name, p in model.named_parameters():
            w = want[name]
            if w is None and p.grad is not None:
                why = (
                    "frozen parameters (requires_grad=False) get no gradient"
                    if not p.requires_grad
                    else "no replica used this parameter, so none has a gradient for it: leave "
                    ".grad as None, as one device does"
                )
                fail(number, f"{where}: {name} got a gradient. {why}.")
            if w is not None and p.grad is None:
                fail(number, f"{where}: {name} has no gradient: sum the replicas' gradients onto "
                     "the model's own parameters")  # fmt: skip
            if w is not None and not torch.allclose(p.grad, w, rtol=1e-10, atol=1e-12):
                ratio = (p.grad.norm() / w.norm()).item()
                if abs(ratio * chunks - 1) < 1e-6:
                    hint = (
                        f"it is 1/{chunks} of one device's: the replicas' gradients add up to "
                        "the batch's, sum them, do not average"
                    )
                elif no_gather and "3, 3, 3, 1" in label:
                    hint = (
                        "with chunks of different sizes each replica's mean loss must be "
                        "weighted by its share of the samples"
                    )
                else:
                    hint = "every replica's gradient must be added, each once"
                fail(number, f"{where}: {name}'s gradient differs from one device's: {hint}.")
        if abs(loss.item() - want_loss) > 1e-12:
            fail(number, f"{where}, the loss you return is not the whole batch's mean loss")


def _reference_step(model, x, y, k):
    """The check's own DataParallel step (refused as an answer)."""
    chunks = list(zip(x.chunk(k), y.chunk(k)))
    replicas = [copy.deepcopy(model) for _ in chunks]
    with ThreadPoolExecutor(len(chunks)) as pool:
        outs = list(pool.map(lambda r_c: r_c[0](r_c[1][0]), zip(replicas, chunks)))
    loss = nn.functional.cross_entropy(torch.cat(outs), y)
    loss.backward()
    for p, *copies in zip(model.parameters(), *(r.parameters() for r in replicas)):
        grads = [c.grad for c in copies if c.grad is not None]
        p.grad = sum(grads) if grads else None
    return loss.detach()


def check_data_parallel_step(data_parallel_step) -> None:
    """Exercise 02.1: ``data_parallel_step(model, x, y, k)``: scatter, replicate, parallel_apply,
    gather, loss, backward and the reduce onto the model, equal to one device."""
    refuse_copies("02.1", data_parallel_step, [_reference_step],
                  "write the step yourself, not the check's own copy")  # fmt: skip
    _check("02.1", data_parallel_step, no_gather=False)
    passed("02.1", f"gradients and loss equal one device's for {len(CASES)} models and batches, "
           "the replicas running in threads")  # fmt: skip


def check_local_loss_step(local_loss_step) -> None:
    """Exercise 02.2: ``local_loss_step(model, x, y, k)``: each replica computes the loss of its own
    chunk (no gather); the gradients on the model still equal one device's on the whole batch."""
    _check("02.2", local_loss_step, no_gather=True)
    passed("02.2", f"gradients equal one device's for {len(CASES)} models and batches, with no "
           "output gathered, chunks of unequal size included")  # fmt: skip


__all__ = ["check_data_parallel_step", "check_local_loss_step"]
