"""Every call into torch.distributed, seen in torch's dispatcher: one mode that measurement and the
exercise checks build on.

Whatever name the Python call was made under (``dist.all_reduce``, the process group's method,
the functional collectives DTensor uses), it ends in the dispatcher as a ``c10d`` op
(``c10d.allreduce_``, ``c10d.send``) or a functional one (``_c10d_functional.all_reduce``).
:class:`CommunicationMode` recognises those and hands each to :meth:`~CommunicationMode.before`
(the op has not run: a check can refuse it) and :meth:`~CommunicationMode.after` (its output is
there) as a :class:`Call`. It needs no change to the code it watches; backward runs in the same
thread on CPU, so a ``loss.backward()`` inside the block is seen too.

- :class:`CollectiveCounter` counts collectives and their bytes (notebooks 06 to 10);
- :class:`AllToAllCounter` counts what an all-to-all sends to other ranks (notebook 10).

    with CollectiveCounter() as c:
        dist.all_reduce(t)
    c.counts, c.calls        # Counter({'all_reduce': 1}), [('all_reduce', 4 * t.numel())]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# where torch.distributed's ops live in the dispatcher, across torch versions
NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")

# ops that move no data: waits, barriers, a functional collective's result wrapped for autograd
BOOKKEEPING = ("wait_tensor", "barrier", "_wrap_tensor_autograd", "monitored_barrier_")

# op name -> (kind, where nccl-tests' "size" is: the all-reduced tensor, the gathered output, the
# reduce-scattered input, the all-to-all's input); an argument's index, or "out": the return value
SIZES = {
    "allreduce_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", "out"),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_": ("reduce", 0),
    "broadcast_": ("broadcast", 0),
    "broadcast": ("broadcast", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "all_to_all_single": ("all_to_all", 0),
}
SEND = {"send": ("send", 0)}


def nbytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list; 0 for anything else."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(y) for y in x)
    return 0


def tensors(values) -> list[torch.Tensor]:
    """The tensors in ``values``, lists and tuples opened."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += tensors(v)
    return out


@dataclass
class Call:
    """One op of torch.distributed as the dispatcher runs it."""

    namespace: str  # "c10d", "_c10d_functional", ...
    name: str  # without namespace and overload: "allreduce_", "send", "all_to_all_single"
    args: tuple
    kwargs: dict
    func: object = field(repr=False, default=None)  # the OpOverload, for its schema

    def size(self, out=None, table=SIZES) -> tuple[str, int] | None:
        """``(kind, bytes)`` as nccl-tests sizes it (``table``: op name -> (kind, where)), or None
        for an op the table does not list. ``out``: the op's result, for the functional ops whose
        size is their output."""
        if self.name not in table:
            return None
        kind, where = table[self.name]
        return kind, nbytes(out if where == "out" else self.args[where])

    def shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of every tensor handed to the op, outputs given as arguments included."""
        return [(tuple(t.shape), t.dtype) for t in tensors(self.args)]

    def argument(self, name: str, default=None):
        """The argument the op's schema calls ``name`` (``process_group``, ``group_size``)."""
        if name in self.kwargs:
            return self.kwargs[name]
        schema = getattr(self.func, "_schema", None)
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if a.name == name:
                return self.args[i] if i < len(self.args) else default
        return default

    def group_size(self) -> int | None:
        """Ranks in the op's group: the process group's size, a functional op's ``group_size``,
        or its ``group_name`` looked up; None where the op names no group."""
        group = self.argument("process_group")
        if group is not None:
            import torch.distributed as dist

            if isinstance(group, torch.ScriptObject):  # the dispatcher hands it over boxed
                group = dist.ProcessGroup.unbox(group)
            return int(group.size())
        if self.argument("group_size") is not None:
            return int(self.argument("group_size"))
        name = self.argument("group_name")
        if name is None:
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(name).size())


def recognise(func, args, kwargs) -> Call | None:
    """The :class:`Call` for ``func`` if it is an op of torch.distributed, else None."""
    namespace = getattr(func, "namespace", "")
    if namespace not in NAMESPACES:
        return None
    return Call(namespace, func._schema.name.split("::")[-1], tuple(args), kwargs, func)


class CommunicationMode(TorchDispatchMode):
    """Runs every op as usual and shows each one of torch.distributed's to :meth:`before` and
    :meth:`after`, which subclasses override (raising in :meth:`before` refuses the op)."""

    def before(self, call: Call) -> None:
        """``call`` is about to run."""

    def after(self, call: Call, out) -> None:
        """``call`` ran and returned ``out``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = recognise(func, args, kwargs)
        if call is not None:
            self.before(call)
        out = func(*args, **kwargs)
        if call is not None:
            self.after(call, out)
        return out


@dataclass
class CollectiveCounter(CommunicationMode):
    """``with CollectiveCounter() as c: ...`` then ``c.counts`` (``{"all_reduce": 2}``) and
    ``c.bytes``: per kind, the collectives' sizes as nccl-tests defines them (the all-reduced
    tensor, the gathered output, the reduce-scattered input); ``c.calls``: ``(kind, bytes)`` in
    order. :func:`~course_utils.comm.ledger.ring_bytes` turns a size into the bytes each rank
    sends.

    Both the c10d ops (``dist.all_reduce``) and the functional ones DTensor uses are seen.
    ``p2p=True`` counts point-to-point sends as well (kind ``"send"``, the bytes sent).
    """

    counts: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    calls: list = field(default_factory=list)
    p2p: bool = False

    def __post_init__(self):
        super().__init__()

    def after(self, call: Call, out) -> None:
        if call.namespace not in ("c10d", "_c10d_functional"):
            return
        sized = call.size(out, {**SIZES, **SEND} if self.p2p else SIZES)
        if sized is not None:
            kind, size = sized
            self.counts[kind] += 1
            self.bytes[kind] += size
            self.calls.append((kind, size))


class AllToAllCounter(CommunicationMode):
    """``with AllToAllCounter(rank, n) as c: ...`` then ``c.values``: the values this rank's
    ``all_to_all_single`` calls sent to *other* ranks (the slice it keeps left out), uneven splits
    counted as they were; ``c.calls``: the number of calls. ``rank`` and ``n``: this rank's place
    in the group the calls use, and its size."""

    def __init__(self, rank: int, n: int):
        super().__init__()
        self.rank, self.n, self.values, self.calls = rank, n, 0, 0

    def before(self, call: Call) -> None:
        if call.namespace == "c10d" and call.name.endswith("alltoall_base_"):
            args = call.args
            # (output, input, process_group, output_split_sizes, input_split_sizes, ...)
            inp, splits = args[1], list(args[3])
            rows = inp.shape[0]
            splits = splits or [rows // self.n] * self.n  # no splits given: equal ones
            per_row = inp.numel() // max(rows, 1)
            self.values += sum(s for j, s in enumerate(splits) if j != self.rank) * per_row
            self.calls += 1


__all__ = [
    "BOOKKEEPING",
    "NAMESPACES",
    "AllToAllCounter",
    "Call",
    "CollectiveCounter",
    "CommunicationMode",
    "nbytes",
    "recognise",
    "tensors",
]
