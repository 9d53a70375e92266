"""Measure tensor parallelism against the papers: collectives counted, activation memory.

- :class:`~course_utils.comm.CollectiveCounter` records every c10d collective a rank issues
  (forward and backward), with the bytes of its input, from torch's dispatcher: it sees the
  from-scratch layers' calls and torch's own (DTensor, DDP) the same way, and needs no change to
  the code it watches; :func:`~course_utils.comm.ring_bytes` turns its sizes into bytes sent.
- :func:`megatron_bytes_per_layer`: Narayanan et al. 2021 (§3.2): a transformer layer's tensor
  parallelism sends ``8·b·s·h·(t−1)/t`` values per rank per layer and micro-batch (two
  all-reduces forward, two backward, each sending ``2(t−1)/t`` of a ``b·s·h`` tensor).
- :func:`activation_bytes_per_layer`: Korthikanti et al. 2022, Table 2, re-derived for any
  activation dtype (see its docstring).

Taught in notebook 06.
"""

from __future__ import annotations

import torch


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
    "activation_bytes_per_layer",
    "dropout_mask_bytes",
    "megatron_bytes_per_layer",
]
