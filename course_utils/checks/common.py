"""What every exercise check shares: the error, the success line, running the student's code."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode


class ExerciseError(AssertionError):
    """The student's answer is not right yet; the message says where, and gives a hint."""


def passed(number: str, what: str) -> None:
    """The one line a passing check prints."""
    print(f"✓ exercise {number}: {what}")


def fail(number: str, message: str) -> None:
    raise ExerciseError(f"exercise {number}: {message}")


@contextlib.contextmanager
def refused(number: str, student_fn, reference, message: str):
    """While the student's code runs, ``reference`` (a function the package holds) raises instead.

    Every name bound to it is replaced: in the package's modules (so that a function of the
    package that calls it refuses too) and in the globals of ``student_fn``, the notebook's
    namespace when it was defined in a cell. All are restored on exit.
    """

    def refuse(*args, **kwargs):
        raise ExerciseError(f"exercise {number}: {message}")

    namespaces = [
        vars(m)
        for name, m in list(sys.modules.items())
        if m is not None and (name == "course_utils" or name.startswith("course_utils."))
    ]
    namespaces.append(getattr(student_fn, "__globals__", {}))
    patched = []
    for ns in namespaces:
        for key, value in list(ns.items()):
            if value is reference:
                ns[key] = refuse
                patched.append((ns, key))
    try:
        yield
    finally:
        for ns, key in patched:
            ns[key] = reference


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
    from ..launcher import RankFailedError, launch

    try:
        return launch(worker, world_size, echo=False, **kwargs)
    except RankFailedError as e:
        if e.exc_type == "NotImplementedError":
            raise NotImplementedError(e.exc_message) from None
        if e.exc_type == "ExerciseError":
            raise ExerciseError(f"rank {e.rank}: {e.exc_message}") from None
        raise


def _code_shape(code) -> tuple:
    """What a function does, without its names, docstring or line numbers: its bytecode, the
    globals and attributes it reaches, and its constants (nested functions compared the same way)."""
    consts = []
    for i, c in enumerate(code.co_consts):
        if i == 0 and (c is None or isinstance(c, str)):
            continue  # the docstring's place (None when there is none)
        consts.append(_code_shape(c) if hasattr(c, "co_code") else repr(c))
    return (code.co_code, code.co_names, tuple(consts))


def same_code(student_fn, reference) -> bool:
    """True when ``student_fn`` is ``reference``, a subclass of it, or a copy of its code pasted
    under another name (local variables renamed or not): the same bytecode, globals and constants."""
    if student_fn is reference:
        return True
    if isinstance(student_fn, type) and isinstance(reference, type):
        if issubclass(student_fn, reference):
            return True
        theirs = [f for f in vars(reference).values() if hasattr(f, "__code__")]
        mine = [f for f in vars(student_fn).values() if hasattr(f, "__code__")]
        return any(  # a method of any length carried over (not a two-line __init__ by chance)
            len(a.__code__.co_code) > 40 and same_code(a, b) for a in mine for b in theirs
        )
    a, b = getattr(student_fn, "__code__", None), getattr(reference, "__code__", None)
    return a is not None and b is not None and _code_shape(a) == _code_shape(b)


def refuse_copies(number: str, student_fn, references, message: str) -> None:
    """Fail when the student's function is one of ``references`` (the package's own versions of
    the answer) or a copy of one of them."""
    for ref in references:
        if same_code(student_fn, ref):
            fail(number, message)
