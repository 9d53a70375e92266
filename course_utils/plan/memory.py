"""Memory per GPU: the model states of one shard (ZeRO), the activations in flight, the logits.

Activations, per layer and micro-batch, are counted tensor by tensor as Korthikanti et al. (2022,
§4, Table 2) count them, generalised to any MLP width, SwiGLU, grouped-query attention, with or
without dropout, and with attention that does or does not keep its ``s × s`` scores:

=============================================  ===============================  ===============
saved for backward                             elements                         split by
=============================================  ===============================  ===============
the two norms' inputs, QKV's and the MLP's     ``4·sbh``                        SP
  inputs
Q, K and V                                     ``sbh·(1 + 2·kv/a)``             TP
the attention output (O's input)               ``sbh``                          TP
the MLP: GeLU's input and down's input         ``2·sbh·f/h`` (SwiGLU ``3·...``)  TP
dropout masks after attention and the MLP      ``2·sbh`` (mask bytes)           SP
materialised scores: softmax out, its          ``a·s²·b·(2 + mask)``            TP
  dropout mask and output
=============================================  ===============================  ===============

With FlashAttention (the default on current GPUs, ``attention="flash"``) the scores are never
stored: backward recomputes them from Q, K, V and the softmax statistics (a few numbers per token
and head, left out). Selective recomputation (Korthikanti et al.) drops the same term by
recomputing it, full recomputation keeps each layer's input only (``sbh``, split by SP) plus one
layer's full activations while it is recomputed. 1F1B keeps ``min(p, m)`` micro-batches in flight
on the first stage (``p + (p-1)/v`` with ``v`` interleaved chunks, Narayanan et al. 2021); the last
stage also keeps one micro-batch's logits for the loss, ``b·s·V/t`` numbers in fp32.
"""

from __future__ import annotations

from ..zero import model_state_bytes
from .model import Choice, Transformer, layers_per_stage, shard_params


def layer_activation_bytes(
    model: Transformer,
    b: int,
    t: int = 1,
    sequence_parallel: bool = False,
    act_bytes: float = 2,
    mask_bytes: float = 1,
    attention: str = "flash",
    recompute: str = "none",
) -> float:
    """Bytes one layer keeps for backward per micro-batch of ``b`` sequences (see the table).
    For the course's GPT with materialised scores this is Korthikanti's ``sbh(34 + 5as/h)`` at
    ``t = 1`` (2-byte values, 1-byte masks)."""
    if attention not in ("flash", "materialized"):
        raise ValueError(f"attention must be 'flash' or 'materialized', not {attention!r}")
    s, h, a = model.seq_len, model.hidden, model.heads
    sbh = s * b * h
    mask = mask_bytes if model.dropout else 0
    sp = t if sequence_parallel else 1
    unsplit = (4 * act_bytes + 2 * mask) * sbh / sp
    qkv = (1 + 2 * model.kv / a) * act_bytes * sbh
    mlp = (3 if model.gated else 2) * model.ffn / h * act_bytes * sbh
    split = (qkv + act_bytes * sbh + mlp) / t
    scores = 0.0
    if attention == "materialized" and recompute == "none":
        per = (2 * act_bytes + mask) if model.dropout else act_bytes
        scores = a * s * s * b * per / t
    return unsplit + split + scores


def activations(
    model: Transformer,
    choice: Choice,
    b: float,
    *,
    sequence_parallel: bool,
    act_bytes: float,
    mask_bytes: float,
    attention: str,
    recompute: str,
    logits_bytes: float = 4,
) -> dict:
    """Bytes of activations on the first and the last stage (the fuller decides)."""
    t, p, m, v = choice.tp, choice.pp, choice.micro_batches, choice.interleave
    per_stage = layers_per_stage(model, choice)
    full = layer_activation_bytes(model, b, t, sequence_parallel, act_bytes, mask_bytes,
                                  attention, "none")  # fmt: skip
    if recompute == "full":
        sp = t if sequence_parallel else 1
        per_layer = act_bytes * model.seq_len * b * model.hidden / sp
        extra = full  # one layer's activations while it is recomputed
    else:
        per_layer = layer_activation_bytes(model, b, t, sequence_parallel, act_bytes, mask_bytes,
                                           attention, recompute)  # fmt: skip
        extra = 0.0
    in_flight = min(p, m) if v == 1 else p + (p - 1) / v  # micro-batches of a stage, at the peak
    first = per_stage * in_flight * per_layer + extra
    logits = logits_bytes * b * model.seq_len * model.padded_vocab(t) / t
    last = per_stage * 1 * per_layer + extra + logits  # the last stage runs each B right after F
    if p == 1:
        first = last = per_stage * per_layer + extra + logits
    return {"first": first, "last": last, "logits": logits, "per_layer": per_layer}


def model_states(
    model: Transformer,
    choice: Choice,
    *,
    param_bytes: float,
    grad_bytes: float,
    k: float,
) -> dict:
    """Bytes of model states per GPU, for every ZeRO stage, on the fullest stage's shard.

    ZeRO-3 keeps ``1/d`` of everything but, at the peak, one unit gathered (a layer, with its
    gradient) and, with a pipeline, the whole stage: torch's pipelining defers the gradients'
    reduce-scatter and the resharding to the last micro-batch (FSDP inside each stage), so the
    stage's parameters and gradients stay whole through the step."""
    psi = shard_params(model, choice.pp, choice.tp, choice.interleave)
    by_stage = [model_state_bytes(psi, choice.dp, z, k, param_bytes, grad_bytes) for z in range(4)]
    unit = model.layer_params() / choice.tp
    if choice.pp > 1:
        by_stage[3] += psi * (param_bytes + grad_bytes)  # gathered for the whole step
    else:
        by_stage[3] += unit * (param_bytes + grad_bytes)  # one layer gathered, its gradient
    return {"psi": psi, "by_stage": by_stage}


__all__ = ["activations", "layer_activation_bytes", "model_states"]
