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
from .model import Choice, Transformer, layers_per_stage, shard_split

# Bytes per parameter, as each framework keeps them: the parameters a step computes with, their
# gradients, the optimizer's state (with the fp32 master copy), and the element sizes of the
# parameter all-gather and the gradient reduction.
STATES = {
    # Megatron-LM with bf16: bf16 parameters, fp32 gradients (``--accumulate-allreduce-grads-in-
    # fp32``, on by default with bf16), fp32 master weights and Adam's two moments: 2 + 4 + 12 =
    # 18 bytes; the distributed optimizer (ZeRO-1) shards the 12 (``6 + 12/d``, Megatron-LM's
    # docs/source/api-guide/dist_optimizer.md); gradients reduced in fp32, parameters gathered in bf16.
    "megatron": {"param": 2, "grad": 4, "optim": 12, "gather": 2, "reduce": 4},
    # FSDP2 as torchtitan runs it (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)):
    # fp32 sharded parameters (the master copy), fp32 sharded gradients, Adam's 8: 16 bytes, all
    # sharded; each layer gathered in bf16 for compute, its gradient reduce-scattered in fp32.
    "fsdp": {"param": 4, "grad": 4, "optim": 8, "gather": 2, "reduce": 4},
    # The ZeRO paper's count (Rajbhandari et al. 2020): fp16 parameters and gradients, fp32 master
    # and Adam: 2 + 2 + 12 = 16 bytes, reduced and gathered in 16 bits.
    "zero": {"param": 2, "grad": 2, "optim": 12, "gather": 2, "reduce": 2},
}


def state_bytes(choice: Choice, states: str | None = None, **override) -> dict:
    """The bytes per parameter a layout keeps: ``states`` names a framework of :data:`STATES`
    (default: ``"fsdp"`` for ZeRO-3, ``"megatron"`` otherwise); ``param_bytes``, ``grad_bytes``
    and ``k`` override its numbers (then the all-gather moves ``param_bytes`` and the reduction
    ``grad_bytes`` per parameter)."""
    name = states or ("fsdp" if choice.zero == 3 else "megatron")
    if name not in STATES:
        raise ValueError(f"states must be one of {sorted(STATES)}, not {name!r}")
    out = dict(STATES[name], name=name)
    given = {k: v for k, v in override.items() if v is not None}
    if given:
        out["name"] = "custom"
        out["param"] = out["gather"] = given.get("param_bytes", out["param"])
        out["grad"] = out["reduce"] = given.get("grad_bytes", out["grad"])
        out["optim"] = given.get("k", out["optim"])
    return out


def layer_activation_bytes(
    model: Transformer,
    b: int,
    t: int = 1,
    sequence_parallel: bool = False,
    act_bytes: float = 2,
    mask_bytes: float = 1,
    attention: str = "flash",
    recompute: str = "none",
    cp: int = 1,
    moe: bool = False,
) -> float:
    """Bytes one layer keeps for backward per micro-batch of ``b`` sequences (see the table),
    each sequence's ``s/cp`` tokens on this GPU. For the course's GPT with materialised scores
    this is Korthikanti's ``sbh(34 + 5as/h)`` at ``t = 1`` (2-byte values, 1-byte masks). A MoE
    layer (``moe``) keeps its MLP's inputs for each of the ``top_k`` routed and the shared
    experts a token visits, and the permuted tokens before and after the experts."""
    if attention not in ("flash", "materialized"):
        raise ValueError(f"attention must be 'flash' or 'materialized', not {attention!r}")
    s, h, a = model.seq_len / cp, model.hidden, model.heads
    sbh = s * b * h
    mask = mask_bytes if model.dropout else 0
    sp = t if sequence_parallel else 1
    unsplit = (4 * act_bytes + 2 * mask) * sbh / sp
    qkv = (1 + 2 * model.kv / a) * act_bytes * sbh
    gates = 3 if model.gated else 2
    if moe and model.moe:
        visits = model.top_k + model.shared_experts
        mlp = visits * gates * (model.expert_ffn or model.ffn) / h * act_bytes * sbh
        mlp += 2 * model.top_k * act_bytes * sbh  # tokens permuted to and from the experts
    else:
        mlp = gates * model.ffn / h * act_bytes * sbh
    split = (qkv + act_bytes * sbh + mlp) / t
    scores = 0.0
    if attention == "materialized" and recompute == "none":
        per = (2 * act_bytes + mask) if model.dropout else act_bytes
        scores = a * s * model.seq_len * b * per / t
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
    t, p, m, v, cp = choice.tp, choice.pp, choice.micro_batches, choice.interleave, choice.cp
    per_stage = layers_per_stage(model, choice)
    moe = model.moe and per_stage > 0
    full = layer_activation_bytes(model, b, t, sequence_parallel, act_bytes, mask_bytes,
                                  attention, "none", cp, moe)  # fmt: skip
    if recompute == "full":
        sp = t if sequence_parallel else 1
        per_layer = act_bytes * model.seq_len / cp * b * model.hidden / sp
        extra = full  # one layer's activations while it is recomputed
    else:
        per_layer = layer_activation_bytes(model, b, t, sequence_parallel, act_bytes, mask_bytes,
                                           attention, recompute, cp, moe)  # fmt: skip
        extra = 0.0
    in_flight = min(p, m) if v == 1 else p + (p - 1) / v  # micro-batches of a stage, at the peak
    first = per_stage * in_flight * per_layer + extra
    logits = logits_bytes * b * model.seq_len / cp * model.padded_vocab(t) / t
    last = per_stage * 1 * per_layer + extra + logits  # the last stage runs each B right after F
    if p == 1:
        first = last = per_stage * per_layer + extra + logits
    return {"first": first, "last": last, "logits": logits, "per_layer": per_layer}


def model_states(model: Transformer, choice: Choice, *, states: dict, prefetch: int = 1) -> dict:
    """Bytes of model states per GPU, for every ZeRO stage, on the fullest stage's shard.

    The dense parameters are sharded over :attr:`Choice.shard_degree` ranks, a MoE stage's
    experts over the ``dp·cp/ep`` ranks holding the same experts. ZeRO-3 (FSDP) keeps ``1/d`` of
    everything and, at the peak, ``1 + prefetch`` layers gathered in 16 bits (the one computing
    and those prefetched) with one layer's unsharded gradient; ``reshard=False`` keeps the whole stage
    gathered between forward and backward; with a pipeline, torch's pipelining defers the
    gradients' reduce-scatter and the resharding to the last micro-batch (FSDP inside each
    stage), so the stage's parameters and gradients stay whole through the step."""
    c = choice
    part = shard_split(model, c.pp, c.tp, c.interleave, c.ep)
    dense, expert = part["dense"], part["expert"]
    psi = dense + expert
    d_dense, d_expert = c.shard_degree, max(1, c.shard_degree // c.ep)
    k, pb, gb = states["optim"], states["param"], states["grad"]
    by_stage = [
        model_state_bytes(dense, d_dense, z, k, pb, gb)
        + model_state_bytes(expert, d_expert, z, k, pb, gb)
        for z in range(4)
    ]
    layer = model.moe_layer_params() if model.moe else model.layer_params()
    unit = (
        layer / c.tp
        if not model.moe
        else (
            (layer - model.moe_layer_expert_params()) / c.tp
            + model.moe_layer_expert_params() / (c.ep * c.tp)
        )
    )
    gathered, grad = states["gather"], states["reduce"]
    if c.pp > 1 or not c.reshard:
        extra = psi * gathered  # the whole stage gathered
        extra += psi * grad if c.pp > 1 else unit * grad
    else:
        extra = (1 + prefetch) * unit * gathered + unit * grad  # computing, prefetched, a gradient
    by_stage[3] += extra
    return {"psi": psi, "dense": dense, "expert": expert, "unit": unit, "by_stage": by_stage}


__all__ = ["STATES", "activations", "layer_activation_bytes", "model_states", "state_bytes"]
