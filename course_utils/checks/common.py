"""What every exercise check shares: the error, the success line, running the student's code."""

from __future__ import annotations

import contextlib
import inspect
import types

import torch
from torch.overrides import TorchFunctionMode

from ..comm.counting import BOOKKEEPING, NAMESPACES, Call, CommunicationMode
from ..launcher import RankFailedError, launch


class ExerciseError(AssertionError):
    """The student's answer is not right yet; the message says where, and gives a hint."""


def passed(number: str, what: str) -> None:
    """The one line a passing check prints."""
    print(f"✓ exercise {number}: {what}")


def fail(number: str, message: str) -> None:
    raise ExerciseError(f"exercise {number}: {message}")


@contextlib.contextmanager
def patched_methods(cls, replacements: dict):
    """Replace methods of ``cls`` (a pybind class such as ProcessGroup included) while the block
    runs. ``replacements`` maps a name to ``make(original)``, which gets the original as a plain
    function of (self, *args) and returns the function to install; all are restored on exit."""
    saved = {}
    for name, make in replacements.items():
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None:
            continue
        raw = vars(owner)[name]
        original = getattr(cls, name)  # the function itself, called with self passed explicitly
        saved[name] = raw if owner is cls else None
        setattr(cls, name, make(original))
    try:
        yield
    finally:
        for name, raw in saved.items():
            if raw is None:
                delattr(cls, name)  # inherited again
            else:
                setattr(cls, name, raw)


C10D_NAMESPACES = NAMESPACES  # the dispatcher's namespaces of torch.distributed's ops


class OnlyCommunication(CommunicationMode):
    """While the student's code runs, every communication op outside ``allowed`` fails the check,
    and the allowed ones are counted (``self.calls``: op name -> calls).

    Every way into torch.distributed ends in the dispatcher as a ``c10d`` op (``c10d.allreduce_``,
    ``c10d.send``, ``c10d.recv_``) or a functional collective (``_c10d_functional.all_reduce``),
    whatever name the Python call was made under: ``dist.all_reduce``, an imported function, the
    process group's own method, the functional collectives. Names in ``allowed`` are the ops' names
    without namespace and overload: ``send``, ``recv_``, ``allreduce_``.
    """

    def __init__(self, number: str, allowed, message: str):
        super().__init__()
        self.number, self.allowed, self.message = number, set(allowed), message
        self.calls: dict[str, int] = {}

    def before(self, call: Call) -> None:
        if call.name in BOOKKEEPING:  # a wait, or a functional collective's result wrapped
            return
        if call.name not in self.allowed:
            fail(self.number, f"{self.message} ({call.namespace}.{call.name} was called)")
        self.calls[call.name] = self.calls.get(call.name, 0) + 1


STORE_METHODS = ("set", "get", "add", "compare_set", "multi_set", "multi_get", "append",
                 "queue_push", "queue_pop")  # fmt: skip


@contextlib.contextmanager
def no_store(number: str):
    """While the block runs, the rendezvous store (every ``dist.Store``: TCPStore, FileStore, the
    PrefixStore the process group keeps) refuses to carry data: it is how ranks find each other,
    not a channel for the exercise's data, which a check of the bytes sent would not see."""
    import torch.distributed as dist

    def refuse(original):
        def refused_store(self, *args, **kwargs):
            fail(number, "your code used the rendezvous store (dist.Store) to pass data between "
                 "ranks: it is how ranks find each other at start-up; send the exercise's data "
                 "with torch.distributed's collectives or point-to-point messages")  # fmt: skip

        return refused_store

    with patched_methods(dist.Store, {name: refuse for name in STORE_METHODS}):
        yield


class RefuseTorch(TorchFunctionMode):
    """While the student's code runs, refuse the torch functions in ``funcs`` and, with
    ``autograd=True``, any operation that autograd records (a forward pass being measured)."""

    def __init__(self, number: str, message: str, funcs=(), autograd: bool = False):
        super().__init__()
        self.number, self.message, self.funcs, self.autograd = number, message, set(funcs), autograd

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.funcs:
            fail(self.number, self.message)
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if self.autograd and any(
            isinstance(t, torch.Tensor) and t.grad_fn is not None for t in outs
        ):
            fail(self.number, self.message)
        return out


def launch_check(number: str, worker, world_size: int, **kwargs):
    """Launch ``worker`` (which calls the student's code in every rank) and unwrap its errors.

    A student copy's ``NotImplementedError`` and a check's :class:`ExerciseError` raised inside a
    rank come back as themselves, with the rank named, instead of as a launcher error.
    """

    try:
        return launch(worker, world_size, echo=False, **kwargs)
    except RankFailedError as e:
        if e.exc_type == "NotImplementedError":
            raise NotImplementedError(e.exc_message) from None
        if e.exc_type == "ExerciseError":
            raise ExerciseError(f"rank {e.rank}: {e.exc_message}") from None
        raise


def _functions(ref) -> list:
    """The functions a reference holds, unwrapped: a method under @torch.no_grad() or
    @contextmanager is the decorator's wrapper, whose code is the decorator's, not the method's."""
    found = list(vars(ref).values()) if isinstance(ref, type) else [ref]
    found = [f.__func__ if isinstance(f, (staticmethod, classmethod)) else f for f in found]
    found += [f.fget for f in found if isinstance(f, property) and f.fget is not None]
    out = []
    for f in found:
        for g in (f, inspect.unwrap(f)):
            if isinstance(g, types.FunctionType) and g not in out:
                out.append(g)
    return out


def _refusing_code(fn, number: str, message: str):
    """A code object that raises the check's refusal, with the free variables of ``fn``'s code (a
    function's code can only be swapped for one with as many), named as ``fn``'s."""
    free = fn.__code__.co_freevars
    text = "def outer():\n"
    text += "".join(f"    {v} = None\n" for v in free)
    text += "    def refuse(*args, **kwargs):\n"
    if free:
        text += f"        ({', '.join(free)},)\n"
    error = f"exercise {number}: {message}"
    text += (
        "        raise __import__('course_utils.checks.common', fromlist=['ExerciseError'])"
        f".ExerciseError({error!r})\n"
    )
    text += "    return refuse\n"
    scope: dict = {}
    exec(compile(text, f"<refused by exercise {number}>", "exec"), scope)
    code = scope["outer"]().__code__
    assert len(code.co_freevars) == len(free)
    return code.replace(co_name=fn.__code__.co_name)


@contextlib.contextmanager
def refuse_calls(number: str, references, message: str):
    """While the block runs, calling any of ``references`` (functions, or classes: every method
    they define) raises the check's refusal, whoever calls it: the student's code under any name
    bound to it, a thread it started, a function of the package that calls it. The function
    objects keep their identity and only their code is swapped, so every alias refuses; all are
    restored on exit. Checks enter it in every process the student's code runs in (the kernel,
    and each rank in its worker).

    It refuses calls, not copies: a student who pastes the package's code has still done the
    exercise's reading, and the check judges what the code does, not what it looks like.
    """
    swapped = []
    for ref in references:
        for fn in _functions(ref):
            if any(fn is f for f, _ in swapped):
                continue
            swapped.append((fn, fn.__code__))
            fn.__code__ = _refusing_code(fn, number, message)
    try:
        yield
    finally:
        for fn, code in swapped:
            fn.__code__ = code
