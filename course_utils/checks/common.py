"""What every exercise check shares: the error, the success line, running the student's code."""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


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
        with refuse_calls(number, (reference,), message):
            yield
    finally:
        for ns, key in patched:
            ns[key] = reference


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


C10D_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class OnlyCommunication(TorchDispatchMode):
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = getattr(func, "namespace", "")
        if namespace in C10D_NAMESPACES:
            name = func._schema.name.split("::")[-1]
            if name not in self.allowed and name not in ("wait_tensor", "barrier"):
                fail(self.number, f"{self.message} ({namespace}.{name} was called)")
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


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


_SKIP = {"CACHE", "NOP", "EXTENDED_ARG", "PRECALL", "PUSH_NULL", "RESUME", "COPY_FREE_VARS"}
_SAME_AS = {"LOAD_METHOD": "LOAD_ATTR", "CALL_METHOD": "CALL", "CALL_FUNCTION": "CALL"}


def _instructions(code, names: bool = True) -> tuple:
    """The instructions of ``code`` as (operation, argument), the same for a copy compiled
    elsewhere: locals by position, jumps by instruction index, and an attribute call the same
    whether the compiler saw the module imported in that cell (LOAD_ATTR) or not (LOAD_METHOD)."""
    ins = [i for i in dis.get_instructions(code) if i.opname not in _SKIP]
    index = {i.offset: k for k, i in enumerate(ins)}
    out = []
    for i in ins:
        if i.opcode in dis.hasjrel or i.opcode in dis.hasjabs:
            arg = index.get(i.argval, -1)
        elif i.opcode in dis.haslocal or i.opcode in dis.hasfree:
            arg = i.arg
        elif hasattr(i.argval, "co_code"):
            arg = "<code>"
        elif not names and i.opcode in dis.hasname:
            arg = "?"  # an attribute or global renamed is still the same code
        else:
            arg = repr(i.argval)
        out.append((_SAME_AS.get(i.opname, i.opname), arg))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _code_shape(code, names: bool = True) -> tuple:
    """What a function does, without its local names, docstring or line numbers: its instructions,
    the globals and attributes it reaches (``names=False``: not even those), and its constants
    (nested functions compared the same way)."""
    consts = []
    for i, c in enumerate(code.co_consts):
        if i == 0 and (c is None or isinstance(c, str)):
            continue  # the docstring's place (None when there is none)
        consts.append(_code_shape(c, names) if hasattr(c, "co_code") else repr(c))
    return (_instructions(code, names), code.co_names if names else (), tuple(consts))


# Longer than this (bytes of bytecode), the same instructions with other attribute and global names
# are a copy with names changed, not a coincidence.
RENAMED_COPY_BYTES = 120


def _same_shape(a, b) -> bool:
    if _code_shape(a) == _code_shape(b):
        return True
    return len(a.co_code) > RENAMED_COPY_BYTES and _code_shape(a, False) == _code_shape(b, False)


def same_code(student_fn, reference) -> bool:
    """True when ``student_fn`` is ``reference``, a subclass of it, or a copy of its code pasted
    under another name (local variables renamed or not): the same bytecode, globals and constants."""
    if student_fn is reference:
        return True
    if isinstance(student_fn, type) and isinstance(reference, type):
        if issubclass(student_fn, reference):
            return True
        theirs, mine = _functions(reference), _functions(student_fn)
        return any(  # a method of any length carried over (not a two-line __init__ by chance)
            len(a.__code__.co_code) > 40 and same_code(a, b) for a in mine for b in theirs
        )
    a, b = getattr(student_fn, "__code__", None), getattr(reference, "__code__", None)
    return a is not None and b is not None and _same_shape(a, b)


def _functions(ref) -> list:
    """The functions a reference holds, unwrapped: a method under @torch.no_grad() or
    @contextmanager is the decorator's wrapper, whose code is the decorator's, not the method's."""
    found = [v for v in vars(ref).values()] if isinstance(ref, type) else [ref]
    found = [f.__func__ if isinstance(f, (staticmethod, classmethod)) else f for f in found]
    return [inspect.unwrap(f) for f in found if hasattr(inspect.unwrap(f), "__code__")]


def _codes(references) -> list:
    return [f.__code__ for ref in references for f in _functions(ref)]


@contextlib.contextmanager
def refuse_calls(number: str, references, message: str):
    """While the block runs, any call of ``references`` (functions, or classes' methods) or of a
    copy of their code (pasted into a helper under another name, locals renamed) fails the check.

    The names a student could reach are patched by :func:`refused`; this catches what patching
    cannot: a copy of the package's code, wherever it is defined and however it is called.
    """
    codes = _codes(references)
    seen: dict = {}
    hit = []

    previous = sys.getprofile()

    def watch(frame, event, arg):
        if previous is not None:  # an enclosing refuse_calls (or a profiler) keeps watching
            previous(frame, event, arg)
        if event != "call" or hit:
            return
        code = frame.f_code
        if code not in seen:
            seen[code] = code in codes or (
                len(code.co_code) > 40 and any(_same_shape(code, c) for c in codes)
            )
        if seen[code]:
            hit.append(code.co_name)

    sys.setprofile(watch)
    try:
        yield
    except Exception:
        sys.setprofile(previous)
        if hit:  # the package's code ran, then something broke: the refusal is the real answer
            fail(number, message)
        raise
    finally:
        sys.setprofile(previous)
    if hit:
        fail(number, message)


def refuse_copies(number: str, student_fn, references, message: str) -> None:
    """Fail when the student's function is one of ``references`` (the package's own versions of
    the answer) or a copy of one of them."""
    for ref in references:
        if same_code(student_fn, ref):
            fail(number, message)
