"""Checks for notebook 06's two communication exercises: Megatron's ``f`` and ``g`` as autograd
functions (06.1), and the vocabulary-parallel cross-entropy (06.3)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..tensor_parallel import comm, loss
from .common import OnlyCommunication, fail, launch_check, no_store, passed, refuse_calls

PACKAGE_F_G = (
    "that is the package's own f / g (course_utils.tensor_parallel.comm), which the check compares "
    "with: write the two autograd functions yourself"
)
REDUCE_ONLY = "f and g need all-reduces only"


NON_CONTIGUOUS = (
    "f's backward all-reduced a tensor that is not contiguous in memory (the gradient it received "
    'came through a transpose): gloo accepts it, NCCL refuses it ("Tensors must be contiguous"), '
    "so this check refuses it too: all-reduce grad.contiguous() (a copy only when needed)"
)


class _ReduceContiguous(OnlyCommunication):
    """All-reduces only, and c10d's in-place one only on contiguous tensors, as NCCL requires."""

    def __init__(self):
        super().__init__("06.1", ("allreduce_", "all_reduce"), REDUCE_ONLY)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "c10d" and func._schema.name == "c10d::allreduce_":
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            if any(isinstance(x, torch.Tensor) and not x.is_contiguous() for x in tensors):
                fail("06.1", NON_CONTIGUOUS)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _judge_f(copy_cls, x, grads, r) -> None:
    """f (CopyToTP): the identity forward, one all-reduce of the input's gradient in backward,
    on a gradient that is not contiguous in memory."""
    xf = x.clone().requires_grad_()
    with OnlyCommunication("06.1", ("allreduce_", "all_reduce"), REDUCE_ONLY) as fwd:
        y = copy_cls.apply(xf)
    if fwd.calls:
        fail("06.1", f"f's forward communicated ({dict(fwd.calls)}): X is already whole on "
             "every rank, so f's forward is the identity")  # fmt: skip
    if not torch.equal(y.detach(), x):
        fail("06.1", "f's forward must return its input unchanged")
    want = sum(grads)
    # a gradient laid out transposed in memory, as one arriving through a transpose is: the
    # all-reduce needs a contiguous tensor
    strided = grads[r].clone().transpose(-1, -2).contiguous().transpose(-1, -2)
    with _ReduceContiguous() as bwd:
        try:
            y.backward(strided)
        except RuntimeError as err:
            if "contiguous" not in str(err):
                raise
            fail("06.1", "f's backward received a gradient that is not contiguous in memory "
                 "(as one that comes through a transpose is) and the all-reduce refused it: "
                 "all-reduce grad.contiguous() (a copy only when needed)")  # fmt: skip
    if sum(bwd.calls.values()) != 1:
        fail("06.1", f"f's backward issued {dict(bwd.calls) or 'no collective'}: it needs "
             "exactly one all-reduce of the input's gradient")  # fmt: skip
    if xf.grad is None or not torch.allclose(xf.grad, want, atol=1e-12):
        fail("06.1", f"rank {r}: f's backward must return the sum over ranks of the gradient "
             "each rank received (each holds only the part that flows through its own "
             "output features)")  # fmt: skip


def _judge_g(reduce_cls, parts, upstream, r) -> None:
    """g (ReduceFromTP): one all-reduce of the partial sums forward, input untouched, the
    identity backward."""
    xg = parts[r].clone().requires_grad_()
    before = xg.detach().clone()
    with OnlyCommunication("06.1", ("allreduce_", "all_reduce"), REDUCE_ONLY) as fwd:
        y = reduce_cls.apply(xg)
    if sum(fwd.calls.values()) != 1:
        fail("06.1", f"g's forward issued {dict(fwd.calls) or 'no collective'}: it needs "
             "exactly one all-reduce of the partial sums")  # fmt: skip
    if not torch.equal(xg.detach(), before):
        fail("06.1", "g changed its input in place: all-reduce works in place, and autograd may "
             "have saved that tensor for the backward of the layer before; reduce a copy")  # fmt: skip
    if not torch.allclose(y.detach(), sum(parts), atol=1e-12):
        fail("06.1", f"rank {r}: g's forward must return the sum of every rank's partial sums")
    with OnlyCommunication("06.1", ("allreduce_", "all_reduce"), REDUCE_ONLY) as bwd:
        y.backward(upstream.clone())
    if bwd.calls:
        fail("06.1", f"g's backward communicated ({dict(bwd.calls)}): dL/dY is already the "
             "same on every rank, so g's backward is the identity")  # fmt: skip
    if xg.grad is None or not torch.allclose(xg.grad, upstream, atol=1e-12):
        fail("06.1", f"rank {r}: g's backward must pass the gradient through unchanged")


def _judge_column_row_mlp(ctx, copy_cls, reduce_cls, x, upstream, g) -> None:
    """f and g around a column-then-row MLP: output and input gradient equal to one process's.
    ``g`` is the generator the worker drew ``x`` and ``upstream`` from: the weights come next."""
    t, r = ctx.world_size, ctx.rank
    d_in, hidden = 4, 6 * t
    w1 = torch.randn(hidden, d_in, generator=g, dtype=torch.float64).to(ctx.device)
    w2 = torch.randn(d_in, hidden, generator=g, dtype=torch.float64).to(ctx.device)
    xm = x.clone().requires_grad_()
    ref = F.linear(F.gelu(F.linear(xm, w1)), w2)
    ref.backward(upstream.clone())
    w1_r = w1.chunk(t, 0)[r].clone().requires_grad_()
    w2_r = w2.chunk(t, 1)[r].clone().requires_grad_()
    xs = x.clone().requires_grad_()
    out = reduce_cls.apply(F.linear(F.gelu(F.linear(copy_cls.apply(xs), w1_r)), w2_r))
    out.backward(upstream.clone())
    for what, a, b in (
        ("output", out.detach(), ref.detach()),
        ("input gradient", xs.grad, xm.grad),
    ):
        if a is None or not torch.allclose(a, b, atol=1e-10):
            fail("06.1", f"rank {r}: a column-then-row MLP built with your f and g gives the "
                 f"wrong {what}")  # fmt: skip


def _f_g_worker(ctx, copy_cls, reduce_cls):
    """One rank of check 06.1: f, then g, then both around an MLP, the package's f and g refused."""
    t, r = ctx.world_size, ctx.rank
    refs = [comm._CopyToTP, comm._ReduceFromTP, comm.copy_to_tp, comm.reduce_from_tp]
    g = torch.Generator().manual_seed(7)  # the same numbers on every rank
    shape = (2, 3, 4)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(ctx.device)
    grads = [torch.randn(shape, generator=g, dtype=torch.float64).to(ctx.device) for _ in range(t)]
    parts = [torch.randn(shape, generator=g, dtype=torch.float64).to(ctx.device) for _ in range(t)]
    upstream = torch.randn(shape, generator=g, dtype=torch.float64).to(ctx.device)
    watch = contextlib.ExitStack()
    watch.enter_context(refuse_calls("06.1", refs, PACKAGE_F_G))
    with watch:
        _judge_f(copy_cls, x, grads, r)
        _judge_g(reduce_cls, parts, upstream, r)
        _judge_column_row_mlp(ctx, copy_cls, reduce_cls, x, upstream, g)
    dist.barrier()
    return True


def check_f_and_g(copy_to_tp_cls, reduce_from_tp_cls) -> None:
    """Exercise 06.1: Megatron's ``f`` (``CopyToTP``) and ``g`` (``ReduceFromTP``) as
    ``torch.autograd.Function`` classes called as ``CopyToTP.apply(x)``."""
    for cls in (copy_to_tp_cls, reduce_from_tp_cls):
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            fail("06.1", f"{getattr(cls, '__name__', cls)} must be a torch.autograd.Function "
                 "subclass with static forward(ctx, x) and backward(ctx, grad)")  # fmt: skip
    for t in (2, 3):
        launch_check("06.1", _f_g_worker, t, copy_cls=copy_to_tp_cls,
                     reduce_cls=reduce_from_tp_cls, timeout=90)  # fmt: skip
    passed("06.1", "f and g on 2 and 3 ranks: one all-reduce each, in the right direction, and a "
           "column-then-row MLP equal to one process")  # fmt: skip


# ---- 06.3 the vocabulary-parallel cross-entropy -----------------------------------------------

PACKAGE_LOSS = (
    "that is the package's own vocab_parallel_cross_entropy, which the check compares with: write "
    "the loss yourself"
)
DTENSOR_LOSS = (
    "torch's loss_parallel (DTensor) computes this loss for you; write it with all-reduces of "
    "per-token numbers"
)
GATHERING = (
    "a rank sent a tensor as large as its logits: the loss needs a few numbers per token, never "
    "the logits themselves"
)


@contextlib.contextmanager
def _no_dtensor():
    from torch.distributed import tensor as dt

    saved = vars(dt.DTensor)["from_local"], dt.distribute_tensor

    def refuse(*args, **kwargs):
        fail("06.3", DTENSOR_LOSS)

    dt.DTensor.from_local, dt.distribute_tensor = staticmethod(refuse), refuse
    try:
        yield
    finally:
        dt.DTensor.from_local, dt.distribute_tensor = saved


class _Small(OnlyCommunication):
    """All-reduces only, each of at most a few numbers per token; counts them."""

    def __init__(self, tokens: int):
        super().__init__("06.3", ("allreduce_", "all_reduce"), "the loss needs all-reduces only")
        self.tokens = tokens

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") in ("c10d", "_c10d_functional"):
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            if any(isinstance(x, torch.Tensor) and x.numel() > 3 * self.tokens for x in tensors):
                fail("06.3", GATHERING)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _loss_worker(ctx, ce_cls, cases):
    t, r = ctx.world_size, ctx.rank
    refs = [loss._VocabParallelCrossEntropy, loss.vocab_parallel_cross_entropy]
    for n, v, dtype, scale, offset in cases:
        g = torch.Generator().manual_seed(n * 1000 + v)  # the same on every rank
        logits = torch.randn(n, v, generator=g, dtype=torch.float64) * scale + offset
        logits = logits.to(ctx.device)  # (n, v): an offset changes no softmax, but overflows exp
        target = torch.randint(v, (n,), generator=g).to(ctx.device)
        target[: min(n, t)] = torch.arange(min(n, t)) * (v // t)  # a target on every rank
        weight = torch.rand(n, generator=g, dtype=torch.float64).to(ctx.device)
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full, target, reduction="none")  # (n,), float64
        (want * weight).sum().backward()
        mine = logits.chunk(t, -1)[r].to(dtype).clone().requires_grad_()  # (n, v/t)
        where = f"{n} tokens, vocabulary {v} on {t} ranks, {str(dtype).replace('torch.', '')}"
        where += f", logits around {offset:g}" if offset else ""
        with refuse_calls("06.3", refs, PACKAGE_LOSS), _no_dtensor(), no_store("06.3"):
            with _Small(n) as fwd:
                got = ce_cls.apply(mine, target.clone())
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (n,):
                fail("06.3", f"{where}: return the per-token loss, shape ({n},)")
            if sum(fwd.calls.values()) > 3:
                fail("06.3", f"{where}: forward issued {sum(fwd.calls.values())} all-reduces; "
                     "three at most (Megatron-LM sends three, two suffice)")  # fmt: skip
            with _Small(n) as bwd:
                (got * weight.to(dtype)).sum().backward()
            if bwd.calls:
                fail("06.3", f"{where}: backward communicated ({dict(bwd.calls)}); the gradient of "
                     "each rank's slice can be computed from what forward kept")  # fmt: skip
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        every = [None] * t  # every rank's loss: equal, when right
        dist.all_gather_object(every, got.detach().double().cpu())
        off = (got.detach().double() - want.detach()).abs().cpu()  # (n,)
        err = off.max().item()
        if not err <= tol:  # also catches nan and inf
            bounds = {q * (v // t) for q in range(t)} | {(q + 1) * (v // t) - 1 for q in range(t)}
            at_edge = torch.tensor([int(y) in bounds for y in target.cpu()])
            if not torch.isfinite(got).all():
                hint = ("exp of large logits overflows: subtract the largest logit of the token "
                        "(over the whole vocabulary, every rank's slice) before exponentiating")  # fmt: skip
            elif max((e - every[0]).abs().max().item() for e in every) > tol:
                hint = ("the ranks return different losses for the same tokens: the largest logit "
                        "and the sum of exp must be over the whole vocabulary (all-reduce the max "
                        "before shifting by it), so that every rank ends with the same numbers")  # fmt: skip
            elif bool((off > tol).any()) and bool(at_edge[off > tol].all()):
                hint = (f"only tokens whose target is the first or last id of a rank's range are "
                        f"wrong: rank r holds ids r·{v // t} .. (r+1)·{v // t} − 1, end "
                        "excluded, so check the ends of your range")  # fmt: skip
            else:
                hint = ("the loss is log(sum over the whole vocabulary of exp(logit)) minus the "
                        "target's logit, and the target's logit lives on one rank only: the "
                        "others must add 0 for it (mask the targets outside your range)")  # fmt: skip
            fail("06.3", f"{where}: rank {r}'s loss differs from one process by {err:.2g}: {hint}")
        want_grad = full.grad.chunk(t, -1)[r]
        gerr = (mine.grad.double() - want_grad).abs().max().item() if mine.grad is not None else 1
        if not gerr <= tol:
            fail("06.3", f"{where}: rank {r}'s gradient of its logits differs from one process by "
                 f"{gerr:.2g}: d loss / d logit is softmax minus one-hot(target), on this rank's "
                 "slice, times the upstream gradient of that token")  # fmt: skip
    dist.barrier()
    return True


def check_vocab_parallel_cross_entropy(ce_cls) -> None:
    """Exercise 06.3: ``VocabParallelCrossEntropy.apply(logits_shard, target)`` -> per-token loss
    ``(N,)`` from logits ``(N, V/t)`` sharded by vocabulary (rank ``r`` holds tokens
    ``r·V/t .. (r+1)·V/t − 1``), equal to one process in value and gradient, with all-reduces of
    per-token numbers only and no communication in backward."""
    cases = [
        (6, 12, torch.float64, 1.0, 0.0),
        (5, 24, torch.float64, 3.0, 0.0),
        (8, 36, torch.float32, 3.0, 100.0),  # exp(100) overflows float32
    ]
    for t in (2, 3):
        launch_check("06.3", _loss_worker, t, ce_cls=ce_cls, cases=cases, timeout=90)
    passed("06.3", "per-token loss and gradient equal to one process on 2 and 3 ranks, in float32 "
           "with logits large enough to overflow exp, without sending the logits")  # fmt: skip


__all__ = ["check_f_and_g", "check_vocab_parallel_cross_entropy"]
