"""Catch, on a CPU-only machine, the tensors a rank creates off its device.

On a node with one GPU per rank, ``ctx.device`` is ``cuda:r``. A tensor made without
``device=`` (``torch.empty(shape)``), a batch never moved, or a module never moved stays on the
CPU, and the first op that meets ``cuda:r`` tensors fails; so does an NCCL collective given a
CPU tensor. On a laptop or in CI every rank computes on the CPU, so the same code runs and the
bug hides until the course meets a GPU node.

:func:`check_devices` makes it visible on CPU. Inside it, every tensor that would be on the CPU
of a GPU node is *tagged* with where it was made:

- factory calls (``torch.empty``, ``zeros``, ``randn``, ``tensor``, ...) without ``device=``, or
  with a literal ``device="cpu"``; ``torch.from_numpy``; ``.cpu()`` and ``.to("cpu")``;
- what is computed from tagged tensors only, ``*_like`` / ``new_*`` of a tagged tensor, and the
  parameters built from them (a module constructed and never moved).

``.to(ctx.device)`` (any ``torch.device``), ``.cuda()``, ``.type_as(t)`` and
``device=ctx.device`` give an untagged tensor. When such a move returns its own input, as it
does on a CPU machine, it hands back a view instead, so the original keeps its tag, as it keeps
its place on a GPU node: ``x.to(device)`` without ``x = ...`` is caught.

A check then fails an op that mixes tagged tensors with untagged ones (a 0-dim tagged tensor is
allowed, as a CPU scalar is beside CUDA tensors), a collective, ``send``/``recv`` or
``batch_isend_irecv`` given a tagged tensor, and ``DistributedDataParallel`` or ``PipelineStage``
given a module with tagged parameters. The error names the line that made the tensor.

It is a check, not a simulation: tensors that only ever meet each other on the CPU pass unseen,
and tensors that arrive from elsewhere (DataLoader worker processes, ``torch.load``) count as
where the code put them next. ``launch`` turns it on for CPU ranks when
``COURSE_CHECK_DEVICES=1`` (``make test`` sets it) or ``check_devices=True``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ..compat import tensor_factories

ENV = "COURSE_CHECK_DEVICES"

FACTORIES = tensor_factories()
ALWAYS_CPU = {torch.from_numpy, torch.frombuffer}
LIKE = {
    torch.empty_like,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
}
NEW = {
    torch.Tensor.new_empty,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_full,
    torch.Tensor.new_tensor,
}
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.type_as}
# Ops where a CPU tensor beside a device tensor is fine: copies and indexing with CPU indices.
MIXING_ALLOWED = {torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__}
# Two tensors, metadata only (Module._apply asks this before swapping a parameter's data).
METADATA = {torch._has_compatible_shallow_copy_type, torch.is_same_size}
SET_DATA = torch.Tensor.data.__set__  # `param.data = t`: param now lives where t does
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "batch_isend_irecv",
)
# isend / irecv stay as they are: torch tells P2POps apart by identity (`op.op is isend`). Their
# tensors are checked when they go through batch_isend_irecv, and by the mode as soon as they meet
# the rank's device.
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TAGS: WeakIdKeyDictionary = (
    WeakIdKeyDictionary()
)  # tensor -> where it was made (CPU on a GPU node)


class OffDeviceError(RuntimeError):
    """A tensor that would sit on the CPU of a GPU node meets the rank's device."""


def _site() -> str:
    """The first caller outside torch and this module: where the tensor was made."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_TORCH, _HERE)) and "<frozen" not in path:
            break
        frame = frame.f_back
    if frame is None:
        return "inside torch"
    code = frame.f_code
    where = os.path.basename(code.co_filename)
    if "ipykernel_" in code.co_filename or where.startswith("<"):
        where = "a notebook cell"
    return f"{code.co_name}() at line {frame.f_lineno} of {where}"


def _caller_is_torch() -> bool:
    """Whether the op being checked was called by torch's own Python code."""
    frame = sys._getframe(2)  # _caller_is_torch <- __torch_function__ <- the caller
    return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH)


def _placement(device, caller_is_torch: bool) -> str | None:
    """``"cpu"``, ``"device"`` (the rank's), or ``None`` when no device is named.

    A literal ``"cpu"`` in course or notebook code means the CPU on every node. Any
    ``torch.device`` is taken to be the rank's (``ctx.device``, which on a CPU machine compares
    equal to ``torch.device("cpu")``). torch's own code names devices as strings it picked for the
    backend ("cpu" for gloo, "cuda" for NCCL): trusted as the right device.
    """
    if device is None:
        return None
    if isinstance(device, str) and device.startswith("cpu") and not caller_is_torch:
        return "cpu"
    return "device"


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _site_of(t) -> str | None:
    return _TAGS.get(t) if isinstance(t, torch.Tensor) else None


def _tag(value, site: str | None) -> None:
    """Tag (``site``) or untag (``None``) every tensor in ``value``."""
    for t in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(t, torch.Tensor):
            if site is None:
                _TAGS.pop(t, None)
            else:
                _TAGS[t] = site


def _move_target(func, args, kwargs):
    """Where a move sends its tensor: ``("tensor", t)``, a device argument, or ``None``."""
    if func is torch.Tensor.type_as:
        return "tensor", args[1]
    target = kwargs.get("device")
    if target is None:
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                return "tensor", a
            if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                return "device", a
        return None
    return "device", target


class _Mode(TorchFunctionMode):
    def __init__(self, rank: int, device: torch.device):
        super().__init__()
        self.rank, self.device = rank, device

    def fail(self, what: str, site: str, fix: str) -> None:
        raise OffDeviceError(
            f"rank {self.rank}: {what}. On a node with one GPU per rank that tensor is on the CPU "
            f"while the rank computes on cuda:{self.rank}, and this line fails there. The tensor "
            f"was made in {site}. {fix} (Found by COURSE_CHECK_DEVICES, which checks on CPU "
            "what a GPU node would refuse.)"
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES or func in ALWAYS_CPU or func in LIKE or func in NEW:
            placed = _placement(kwargs.get("device"), _caller_is_torch())
            out = func(*args, **kwargs)
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if any(out is a for a in args):
                return out  # torch.as_tensor(t): t itself, unchanged
            if func in ALWAYS_CPU or placed == "cpu":
                _tag(out, _site())
            elif placed is None:  # where its input is (*_like, new_*, tensor(t)), else the CPU
                _tag(out, _site_of(source) if source is not None else _site())
            return out
        if func in MOVES:
            if func is torch.Tensor.cpu:
                site = _site()
            elif func is torch.Tensor.cuda:
                site = None
            else:
                target = _move_target(func, args, kwargs)
                if target is None:  # a dtype or memory format only: it stays where it is
                    site = _site_of(args[0])
                elif target[0] == "tensor":
                    site = _site_of(target[1])
                else:
                    site = _site() if _placement(target[1], _caller_is_torch()) == "cpu" else None
            out = func(*args, **kwargs)
            if out is args[0] and site != _site_of(out):
                # A move that returns its input (always, between equal devices) hands back a view:
                # on a GPU node the original stays where it was, and so does its tag here.
                out = out.view_as(out)  # the mode is off inside its own handler
            _tag(out, site)
            return out
        if func == SET_DATA:
            out = func(*args, **kwargs)
            _tag(args[0], _site_of(args[1]))
            return out
        if func in METADATA:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        if not tensors:
            return func(*args, **kwargs)
        sites = [_site_of(t) for t in tensors]
        if func not in MIXING_ALLOWED and any(s is None for s in sites):
            off = [(t, s) for t, s in zip(tensors, sites) if s is not None and t.dim() > 0]
            if off:
                name = getattr(func, "__name__", str(func))
                t, site = off[0]
                if isinstance(t, nn.Parameter):
                    kind = "a parameter"
                    fix = "Move the module to the rank's device (`model.to(ctx.device)`) first."
                else:
                    kind = f"a tensor {tuple(t.shape)}"
                    fix = "Create it with device=ctx.device, or move it: x = x.to(ctx.device)."
                self.fail(
                    f"`{name}` mixes {kind} made without a device with tensors on the rank's device",
                    site,
                    fix,
                )
        out = func(*args, **kwargs)
        if all(s is not None for s in sites):
            _tag(out, sites[0])
        return out


class _CheckedCollective:
    """``dist.<name>`` with its tensors checked first.

    It compares and hashes equal to the function it wraps, for code that looks functions up in
    lists or sets.
    """

    def __init__(self, name: str, fn, mode: _Mode):
        self.name, self.fn, self.mode = name, fn, mode
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        items = list(args) + list(kwargs.values())
        for a in list(items):
            if isinstance(a, (list, tuple)):
                items.extend(getattr(op, "tensor", op) for op in a)  # P2POp carries .tensor
        for t in items:
            site = _site_of(t)
            if site is not None:
                self.mode.fail(
                    f"dist.{self.name} was given a tensor {tuple(t.shape)} made without a device; "
                    "NCCL moves GPU tensors only",
                    site,
                    "Create it with device=ctx.device, or move it: x = x.to(ctx.device).",
                )
        return self.fn(*args, **kwargs)

    def __eq__(self, other) -> bool:
        return other is self or other is self.fn

    def __hash__(self) -> int:
        return hash(self.fn)


def _module_owners():
    """Constructors that take a module which must already be on the rank's device."""
    from torch.nn.parallel import DistributedDataParallel

    owners = [(DistributedDataParallel, "DistributedDataParallel")]
    with contextlib.suppress(ImportError):
        from torch.distributed.pipelining import PipelineStage

        owners.append((PipelineStage, "PipelineStage"))
    return owners


def _guard_init(cls, label: str, mode: _Mode):
    original = cls.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        module = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)), nn.Module()
        )
        for name, p in module.named_parameters():
            site = _site_of(p)
            if site is not None:
                mode.fail(
                    f"{label} was given a module whose parameter {name!r} was made without a "
                    "device (its collectives run in C++, where only this check at the door can see it)",
                    site,
                    f"Move the module first: {label}(model.to(ctx.device), ...).",
                )
        original(self, *args, **kwargs)

    cls.__init__ = init
    return original


@contextlib.contextmanager
def check_devices(rank: int, device: torch.device):
    """Run the enclosed code with the check on (see the module docstring)."""
    mode = _Mode(rank, device)
    original = nn.Parameter.__dict__["__new__"]  # the staticmethod itself, restored as it was
    original_new = nn.Parameter.__new__
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def parameter_new(cls, data=None, requires_grad=True):
        p = original_new(cls, data, requires_grad)
        _tag(p, _site_of(data))
        return p

    nn.Parameter.__new__ = staticmethod(parameter_new)
    for name, fn in saved.items():
        setattr(dist, name, _CheckedCollective(name, fn, mode))
    owners = [(cls, _guard_init(cls, label, mode)) for cls, label in _module_owners()]
    try:
        with mode:
            yield mode
    finally:
        nn.Parameter.__new__ = original
        for name, fn in saved.items():
            setattr(dist, name, fn)
        for cls, init in owners:
            cls.__init__ = init


def wanted(flag: bool | None) -> bool:
    """``flag`` if given, else whether ``COURSE_CHECK_DEVICES`` is set to a true value."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")
