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
from .common import fail, passed, refuse_calls

CASES = [
    # label, model, global batch, k
    ("an MLP, 24 samples on 3 replicas", ToyMLP, 24, 3),
    ("an MLP, 10 samples on 4 replicas (chunks of 3, 3, 3, 1)", ToyMLP, 10, 4),
    ("an MLP, 2 samples on 4 replicas (chunk makes only 2 chunks)", ToyMLP, 2, 4),
    ("a model with a frozen layer", FrozenMLP, 12, 3),
    ("a model with a layer forward never uses", UnusedParamMLP, 12, 3),
    ("a model that uses one layer twice", TiedMLP, 16, 2),
]


# how long a replica's forward waits at the barrier for the other replicas before the check calls
# them sequential; only a sequential answer ever waits it out (tests shorten it for those)
REPLICA_WAIT_S = 10.0

_WATCHES: dict[
    int, dict
] = {}  # token -> {"calls": [...], "barrier": Barrier}: shared by deep copies


class _Watched(nn.Module):
    """The model the student's step receives: its forward (and its deep copies') records who ran it,
    in which thread and on what, and waits at a barrier until every chunk's replica has started,
    so that replicas run one after the other can never all pass it."""

    def __init__(self, inner: nn.Module, token: int):
        super().__init__()
        self.inner, self.token = inner, token

    def forward(self, x):
        watch = _WATCHES[self.token]
        first = next(self.inner.parameters())
        with watch["lock"]:
            watch["calls"].append((id(self), threading.get_ident(), x.shape[0], first.data_ptr()))
        try:
            watch["barrier"].wait()
        except threading.BrokenBarrierError:
            watch["broken"] = True
        out = self.inner(x)
        if out.grad_fn is not None:
            with watch["lock"]:
                watch["outputs"][out.grad_fn] = id(self)
        return out


# autograd nodes that reduce a tensor to a loss: above them, outputs are no longer per sample
REDUCTIONS = ("NllLoss", "Mean", "Sum", "MseLoss", "BinaryCrossEntropy", "KlDiv", "Norm")


def _gathering_node(roots, outputs: dict):
    """The first autograd node (from the replicas' outputs up) that takes the per-sample outputs
    of two or more replicas, before any loss or reduction, or None. Seen from the graph that
    backward runs, so it does not matter which thread or API built it."""
    memo: dict = {}
    found = []

    def below(node) -> frozenset:  # replicas whose per-sample outputs reach node
        if node is None:
            return frozenset()
        if node in memo:
            return memo[node]
        if node in outputs:
            memo[node] = frozenset([outputs[node]])
            return memo[node]
        memo[node] = frozenset()
        children = [below(child) for child, _ in node.next_functions]
        reached = frozenset().union(*children) if children else frozenset()
        if len(reached) > 1 and not found:
            found.append(type(node).__name__)
        if any(type(node).__name__.startswith(r) for r in REDUCTIONS):
            reached = frozenset()
        memo[node] = reached
        return reached

    for root in roots:
        below(getattr(root, "grad_fn", None))
    return found[0] if found else None


@contextlib.contextmanager
def _watching_backward(watch):
    """Every backward the student's step runs (Tensor.backward, torch.autograd.backward or .grad,
    in any thread) is inspected for a gather first (``watch["gathers"]``)."""
    real_backward, real_grad = torch.autograd.backward, torch.autograd.grad

    def inspect(roots):
        roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
        node = _gathering_node(roots, dict(watch["outputs"]))
        if node is not None:
            watch["gathers"].append(node)

    def backward(tensors, *args, **kwargs):
        inspect(tensors)
        return real_backward(tensors, *args, **kwargs)

    def grad(outputs, *args, **kwargs):
        inspect(outputs)
        return real_grad(outputs, *args, **kwargs)

    torch.autograd.backward, torch.autograd.grad = backward, grad
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad = real_backward, real_grad


def _refused_parallel(number: str, student_fn):
    """nn.DataParallel, torch.nn.parallel's pieces and the check's own step refuse while the
    student's step runs, under any name and in any thread."""
    import torch.nn.parallel as par

    pieces = [getattr(par, f) for f in ("replicate", "parallel_apply", "scatter", "gather",
                                        "data_parallel") if hasattr(par, f)]  # fmt: skip
    stack = contextlib.ExitStack()
    stack.enter_context(refuse_calls(number, [*pieces, nn.DataParallel],
                        "write the step yourself: torch.nn.parallel's DataParallel and its pieces "
                        "(scatter, replicate, parallel_apply, gather) are what this exercise "
                        "rebuilds"))  # fmt: skip
    stack.enter_context(refuse_calls(number, [_reference_step], "that is the check's own copy of "
                                     "the step: write the step yourself"))  # fmt: skip
    return stack


class _Gathers(TorchFunctionMode):
    """In the calling thread: losses and concatenations, with how many rows they cover."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, int, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is nn.functional.cross_entropy and args:
            self.events.append(("loss", args[0].shape[0], True))
        elif (
            func in (torch.cat, torch.concat, torch.stack)
            and isinstance(out, torch.Tensor)
            and out.dim() > 0
            and not _all_scalars(args[0] if args else (kwargs or {}).get("tensors", ()))
        ):  # stacking the replicas' scalar losses gathers no outputs
            self.events.append(("cat", out.shape[0], out.requires_grad))
        return out


def _all_scalars(tensors) -> bool:
    """Whether every tensor joined is one number (a replica's loss, not a chunk of outputs)."""
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else []
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in tensors)


def _one_device(make, x, y):
    torch.manual_seed(0)
    model = make().double()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return (
        loss.item(),
        [p.grad for p in model.parameters()],
        [n for n, _ in model.named_parameters()],
    )


def _run(number: str, step, make, batch: int, k: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(batch * 7 + k)
    x = torch.randn(batch, 16, generator=g, dtype=torch.float64)
    y = torch.randint(4, (batch,), generator=g)
    chunks = len(x.chunk(k))
    token = len(_WATCHES) + 1
    barrier = threading.Barrier(chunks, timeout=REPLICA_WAIT_S)
    _WATCHES[token] = {"calls": [], "lock": threading.Lock(), "broken": False, "outputs": {},
                       "gathers": [], "barrier": barrier}  # fmt: skip
    model = _Watched(make().double(), token)
    gathers = _Gathers()
    try:
        with _refused_parallel(number, step), gathers, _watching_backward(_WATCHES[token]):
            loss = step(model, x, y, k)
    finally:
        watch = _WATCHES.pop(token)
    return model, x, y, watch, chunks, loss, gathers.events


def _check(number: str, step, no_gather: bool) -> None:
    for label, make, batch, k in CASES:
        model, x, y, watch, chunks, loss, events = _run(number, step, make, batch, k)
        biggest = x.chunk(k)[0].shape[0]
        calls = watch["calls"]
        where = f"for {label}"
        if not calls:
            fail(number, f"{where}, no replica ran forward: copy the model, run each copy")
        sizes = sorted(c[2] for c in calls)
        if max(sizes) > biggest or sum(sizes) != batch:
            fail(number, f"{where}, forward ran on batches of {sizes}: scatter the batch with "
                 f"x.chunk(k) ({chunks} chunks here) and run each replica on its own chunk")  # fmt: skip
        modules = {c[0] for c in calls}
        if len(modules) != chunks:
            fail(number, f"{where}, {len(modules)} module(s) ran forward for {chunks} chunks: "
                 "one replica (a copy of the model) per chunk")  # fmt: skip
        original = next(model.inner.parameters()).data_ptr()
        if sum(1 for c in calls if c[3] == original) > 1:
            fail(number, f"{where}, several replicas computed with the model's own parameters "
                 "(a shallow copy shares them): each replica needs a copy of the parameters, as "
                 "copy.deepcopy makes")  # fmt: skip
        if watch["broken"]:
            fail(number, f"{where}, the replicas did not run at the same time (one waited "
                 f"{REPLICA_WAIT_S:g} s for the others): parallel_apply starts every replica's "
                 "forward in a thread of its own before waiting for any")  # fmt: skip
        if no_gather and watch["gathers"]:
            fail(number, f"{where}, your backward ran through a {watch['gathers'][0]} that "
                 "combined the outputs of several replicas before any loss: compute each "
                 "replica's loss on its own chunk, where its outputs are, and gather nothing")  # fmt: skip
        if no_gather:
            big = [e for e in events if e[1] > biggest and e[2]]
            if big:
                fail(number, f"{where}, a {'loss' if big[0][0] == 'loss' else 'concatenation'} "
                     f"covered {big[0][1]} rows of outputs: compute each replica's loss on its own "
                     "chunk, where its outputs are, and gather nothing")  # fmt: skip
        elif not any(e[1] == batch for e in events):
            fail(number, f"{where}, the outputs were never gathered: DataParallel concatenates "
                 "them on device 0 and computes the loss of the whole batch there")  # fmt: skip
        want_loss, want, names = _one_device(make, x, y)
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            fail(number, f"{where}, return the loss of the whole batch (a scalar tensor)")
        for name, p, w in zip(names, model.inner.parameters(), want):
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
                        "with chunks of different sizes each replica's loss must count in "
                        "proportion to its samples"
                    )
                else:
                    hint = "every replica's gradient must be added, each once"
                fail(number, f"{where}: {name}'s gradient differs from one device's: {hint}.")
        if not abs(loss.item() - want_loss) <= 1e-12:  # a NaN fails too
            fail(number, f"{where}, the loss you return is not the whole batch's mean loss")


def _reference_step(model, x, y, k):
    """The check's own DataParallel step (refused while the student's step runs)."""
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
    _check("02.1", data_parallel_step, no_gather=False)
    passed("02.1", f"gradients and loss equal one device's for {len(CASES)} models and batches, "
           "replicas copied and run side by side in threads, outputs gathered")  # fmt: skip


def check_local_loss_step(local_loss_step) -> None:
    """Exercise 02.2: ``local_loss_step(model, x, y, k)``: each replica computes the loss of its own
    chunk (no gather); the gradients on the model still equal one device's on the whole batch."""
    _check("02.2", local_loss_step, no_gather=True)
    passed("02.2", f"gradients equal one device's for {len(CASES)} models and batches, with no "
           "output gathered, chunks of unequal size included")  # fmt: skip


__all__ = ["check_data_parallel_step", "check_local_loss_step"]
