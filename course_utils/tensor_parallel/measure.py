"""Measure tensor parallelism against the papers: collectives counted, activation memory.

- :class:`CollectiveCounter` records every c10d collective a rank issues (forward and backward),
  with the bytes of its input, from torch's dispatcher: it sees the from-scratch layers' calls and
  torch's own (DTensor, DDP) the same way, and needs no change to the code it watches.
- :func:`megatron_bytes_per_layer`: Narayanan et al. 2021 (§3.2): a transformer layer's tensor
  parallelism sends ``8·b·s·h·(t−1)/t`` values per rank per layer and micro-batch (two
  all-reduces forward, two backward, each sending ``2(t−1)/t`` of a ``b·s·h`` tensor).
- :func:`activation_bytes_per_layer`: Korthikanti et al. 2022, Table 2, re-derived for any
  activation dtype (see its docstring).

Taught in notebook 06.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, where the nccl-tests "size" is: the all-reduced tensor, the gathered output,
# the reduce-scattered input). "out": the functional op's return value.
_OPS = {
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


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


@dataclass
class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...`` then ``c.counts`` (``{"all_reduce": 2}``) and
    ``c.bytes``: per kind, the collectives' sizes as nccl-tests defines them (the all-reduced
    tensor, the gathered output, the reduce-scattered input). :func:`ring_bytes` turns a size into
    the bytes each rank sends.

    Both the c10d ops (``dist.all_reduce``) and the functional ones DTensor uses are seen. Backward
    runs in the same thread on CPU, so a ``loss.backward()`` inside the block is counted too.
    ``p2p=True`` counts point-to-point sends as well (kind ``"send"``, the bytes sent).
    """

    counts: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    calls: list = field(default_factory=list)
    p2p: bool = False

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        ops = {**_OPS, "send": ("send", 0)} if self.p2p else _OPS
        if func.namespace in ("c10d", "_c10d_functional") and name in ops:
            kind, where = ops[name]
            nbytes = _bytes(out if where == "out" else args[where])
            self.counts[kind] += 1
            self.bytes[kind] += nbytes
            self.calls.append((kind, nbytes))
        return out


def ring_bytes(kind: str, nbytes: int, t: int) -> float:
    """Bytes each rank sends in a ring ``kind`` whose full tensor is ``nbytes``:
    all-reduce ``2(t−1)/t``, all-gather and reduce-scatter ``(t−1)/t`` of it; an all-to-all of
    equal splits ``(t−1)/t`` of its input (the rest stays on the rank); a send all of it."""
    if kind == "send":
        return float(nbytes)
    if t == 1:
        return 0.0
    factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}[kind]
    return factor * (t - 1) / t * nbytes


def megatron_bytes_per_layer(b: int, s: int, h: int, t: int, bytes_per_value: int = 2) -> float:
    """Narayanan et al. 2021, §3.2: what one rank sends per transformer layer per micro-batch.

    "Tensors of total size bsh need to be all-reduced among t model replicas twice each in the
    forward and backward pass": four ring all-reduces, each sending ``2(t−1)/t`` of the tensor,
    so ``8·b·s·h·(t−1)/t`` values, times ``bytes_per_value`` (2 for 16-bit activations, 4 here on
    CPU in float32).
    """
    return 8 * b * s * h * (t - 1) / t * bytes_per_value


def dropout_mask_bytes(device, dtype=torch.float32) -> int:
    """Bytes per element of the mask dropout keeps for backward: 1 on a GPU (a fused kernel that
    saves a bool mask), the activation's own size on the CPU (torch multiplies by a mask of the
    input's dtype there)."""
    device = torch.device(device)
    return 1 if device.type == "cuda" else torch.empty((), dtype=dtype).element_size()


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    act_bytes: int = 2,
    mask_bytes: int = 1,
) -> float:
    """Activation bytes one transformer layer keeps for backward, per rank (Korthikanti et al.
    2022, §4 and Table 2), for ``act_bytes``-byte activations and ``mask_bytes``-byte dropout masks.

    The paper's count, per layer, in elements of ``s·b·h`` (or ``a·s²·b`` for attention scores):

    =========================================  ==========  ================  ==============
    saved tensor                               elements    split by TP       split by TP+SP
    =========================================  ==========  ================  ==============
    LayerNorm inputs (2)                       2·sbh       no                yes
    QKV input, MLP input                       2·sbh       no                yes
    Q, K (for QKᵀ), V (for attention · V)      3·sbh       yes               yes
    attention output (proj's input)            sbh         yes               yes
    MLP: GeLU input, down's input              8·sbh       yes               yes
    dropout masks after attention and MLP      2·sbh       no (masks)        yes
    softmax output, dropout output             2·as²b      yes               yes
    softmax dropout mask                       as²b        yes (mask)        yes
    =========================================  ==========  ================  ==============

    With 2-byte activations and 1-byte masks: ``sbh(34 + 5as/h)`` with no parallelism,
    ``sbh(10 + 24/t + 5as/(ht))`` with TP, ``sbh(34/t + 5as/(ht))`` with TP and SP. For float32
    activations (``act_bytes=4``) and 1-byte masks (a GPU) the same table gives
    ``sbh(66 + 9as/h)``; with 4-byte masks too (the CPU: :func:`dropout_mask_bytes`),
    ``sbh(72 + 12as/h)``.
    """
    A, M = act_bytes, mask_bytes
    sbh, as2b = s * b * h, a * s * s * b
    replicated = (2 + 2) * A * sbh + 2 * M * sbh  # LayerNorm inputs, QKV/MLP inputs, two masks
    split = (3 + 1 + 8) * A * sbh + (2 * A + M) * as2b  # Q K V, proj input, MLP, attention
    if sequence_parallel:
        return (replicated + split) / t
    return replicated + split / t


__all__ = [
    "CollectiveCounter",
    "activation_bytes_per_layer",
    "dropout_mask_bytes",
    "megatron_bytes_per_layer",
    "ring_bytes",
]
