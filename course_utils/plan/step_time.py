"""Time per step: compute at an efficiency that depends on the matrices' shape, the bubble, and
each dimension's communication, split into what hides behind compute and what stays exposed.

- **compute**: the layers' FLOPs (:func:`~.model.flops_per_step`) at ``peak · efficiency(b·s/cp)
  · width_factor`` (TP's narrow matrices: :func:`width_factor`) on the fullest stage (``⌈L/(p·v)⌉·v`` layers), plus the head's FLOPs on the last stage;
  plus the element-wise operations between the matrix products, bound by memory bandwidth: each
  byte a layer keeps for backward crosses the GPU's memory about five times (written and read
  again in forward, read in backward, its gradient written and read): ``5 ·`` the layer's
  activation bytes per micro-batch (a third more with full recomputation).
- **bubble**: 1F1B idles ``(p-1)/(m+p-1)`` of the step, i.e. ``compute · (p-1)/m`` of a stage
  without the head (the fill and drain pass through those; the last stage's head only slows the
  ``m`` micro-batches); interleaving ``v`` chunks divides it by ``v`` (Narayanan et al. 2021, §2.2).
- **tp**: Megatron's four all-reduces of ``b·s·h/cp`` values per layer and micro-batch (six with
  full recomputation); sequence parallelism's all-gather/reduce-scatter pairs cost the same.
  Exposed unless ``tp_overlap`` (Megatron-Core's ``--tp-comm-overlap``, torchtitan's async TP).
- **cp**: per layer and micro-batch, K and V all-gathered over the ``cp`` ranks in forward and
  their gradients reduce-scattered in backward (Llama 3's all-gather context parallelism;
  notebook 09's ring moves the same bytes in ``cp-1`` steps). Exposed unless ``cp_overlap``
  (the ring's transfers behind the attention of the chunk in hand).
- **ep**: per MoE layer and micro-batch four all-to-alls (dispatch and combine, forward and
  backward) of the ``top_k`` copies of each token's ``h`` values, the part leaving the node on
  the network (notebook 10's count). Exposed unless ``ep_overlap`` (DeepSeek's DualPipe overlaps
  them with another micro-batch's compute).
- **pp**: per micro-batch an activation forward and its gradient back across each boundary,
  ``b·s·h/(t·cp)`` values per GPU; ``2·(v·m + p - 2)`` messages on the critical path.
- **dp**: every collective is charged its ring latency per message (``(n-1)·α``, twice for an
  all-reduce), so many small messages over thousands of ranks cost what they cost. DDP and ZeRO-1/2
  reduce the gradients in ``dp_bucket_bytes`` buckets (ZeRO-1/2: reduce-scatter, then the
  parameters all-gathered); ZeRO-2 reduces after every micro-batch. ZeRO-3 is FSDP: one all-gather
  per layer before its forward, one before its backward (none with ``reshard=False``) and one
  reduce-scatter after it, every micro-batch, the gathers issued ``prefetch`` layers ahead (1:
  FSDP2's default) and hidden behind that many layers' compute; HSDP adds an all-reduce of each layer's shard across the replicas. Inside a
  pipeline, torch's pipelining gathers each stage once per step and reduces once after the last
  micro-batch. With ``overlap`` (the default) reductions hide behind backward except the last
  bucket (the Ultra-Scale Playbook's condition: exposed = max(0, comm - window) + last bucket),
  gathers behind forward.
"""

from __future__ import annotations

import math

from ..comm.ledger import ring_factor, ring_steps
from ..comm.model import AlphaBeta
from ..pipeline.simulate import theory_bubble
from .model import Choice, Cluster, Transformer, flops_per_step, layers_per_stage


def collective(link: AlphaBeta, op: str, nbytes: float, n: int, messages: float = 1) -> float:
    """Seconds for ``messages`` ring collectives over ``n`` ranks moving ``nbytes`` in all: each
    message pays the ring's latency, ``k(n-1)·α``, and the bytes ``k(n-1)/n·nbytes/β`` once."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return messages * ring_steps(op, n) * link.alpha + ring_factor(op, n) * nbytes / link.beta


def all_to_all(link: AlphaBeta, nbytes: float, n: int) -> float:
    """Seconds for an all-to-all in which each rank holds ``nbytes`` and keeps ``1/n`` of them."""
    if n <= 1:
        return 0.0
    return (
        ring_steps("all_to_all", n) * link.alpha + ring_factor("all_to_all", n) * nbytes / link.beta
    )


def width_factor(model: Transformer, t: int, half: float) -> float:
    """How much slower TP's narrower matrices run: each layer's products weighted by their FLOPs,
    the attention's ``h/t`` wide per GPU (QKV's output, O's input), the MLP's ``ffn/t`` (an
    expert's width for a MoE layer), each at ``width / (width + half)``; their harmonic mean."""
    if not half:
        return 1.0
    mlp = model.active_matmul_params() - model.attn_params()
    ffn = (model.expert_ffn or model.ffn) if model.moe else model.ffn
    parts = [(model.attn_params(), model.hidden / t), (mlp, ffn / t)]
    return sum(w for w, _ in parts) / sum(w * (x + half) / x for w, x in parts)


def dp_ops(model: Transformer, choice: Choice, parts: dict, states: dict, bucket: float,
           layers: int) -> list[tuple]:  # fmt: skip
    """The data-parallel traffic of one step: ``(phase, group, op, bytes, messages, per)`` rows,
    ``phase`` "forward" or "backward", ``group`` "dp" or "replicate", ``per`` "step" or
    "micro-batch" (the row happens that often)."""
    c = choice
    g, r = states["gather"], states["reduce"]
    psi = parts["dense"] + parts["expert"]
    grads, params = psi * r, psi * g

    def buckets(nbytes):
        return max(1, math.ceil(nbytes / bucket))

    if c.zero == 0:
        return [("backward", "dp", "all_reduce", grads, buckets(grads), "step")]
    if c.zero in (1, 2):
        per = "micro-batch" if c.zero == 2 else "step"
        return [("backward", "dp", "reduce_scatter", grads, buckets(grads), per),
                ("forward", "dp", "all_gather", params, buckets(params), "step")]  # fmt: skip
    units = layers
    per = "step" if c.pp > 1 else "micro-batch"
    rows = [("forward", "dp", "all_gather", params, units, per)]
    if c.pp == 1 and c.reshard:
        rows.append(("backward", "dp", "all_gather", params, units, per))
    rows.append(("backward", "dp", "reduce_scatter", grads, units, per))
    if c.replicas > 1:  # HSDP: each layer's gradient shard all-reduced across the replicas
        rows.append(("backward", "replicate", "all_reduce", grads / c.shard_degree, units, per))
    return rows


def step_time(
    model: Transformer,
    cluster: Cluster,
    choice: Choice,
    b: float,
    links: dict,
    parts: dict,
    states: dict,
    *,
    recompute: str,
    sequence_parallel: bool,
    act_bytes: float,
    overlap: bool,
    tp_overlap: bool,
    cp_overlap: bool,
    ep_overlap: bool,
    dp_bucket_bytes: float,
    layer_bytes: float = 0.0,
    overlap_cost: float = 0.0,
    pp_scatter_gather: bool = True,
    prefetch: int = 1,
) -> tuple[dict, dict, dict]:
    """``(time, hidden, extra)``: seconds per step of each exposed term (and their ``total``),
    the seconds of communication each term hid behind compute, and the numbers behind them."""
    c = choice
    t, p, m, v = c.tp, c.pp, c.micro_batches, c.interleave
    link = {k: cluster.intra if where == "intra" else cluster.inter for k, where in links.items()}
    per_stage = layers_per_stage(model, c)
    tokens = b * model.seq_len / c.cp  # one micro-batch's tokens on one GPU
    compute, bubble, elementwise, eff = _compute_and_bubble(
        model, cluster, c, tokens, per_stage, recompute, layer_bytes
    )

    # one micro-batch's forward and backward on this GPU (the windows communication can hide in)
    passes = {"none": 3, "selective": 3, "full": 4}[recompute]
    per_micro = compute / m
    windows = (per_micro / passes, per_micro * (passes - 1) / passes)

    tp_total, tp_exposed = _tp_seconds(
        model, c, link, tokens, per_stage, recompute, act_bytes, compute, tp_overlap
    )
    cp_total, cp_exposed = _cp_seconds(
        model, c, link, b, per_stage, recompute, act_bytes, compute, cp_overlap
    )
    ep_total, ep_exposed = _ep_seconds(
        model, cluster, c, links, tokens, per_stage, recompute, sequence_parallel, act_bytes,
        compute, ep_overlap,
    )  # fmt: skip

    split = t if (sequence_parallel or pp_scatter_gather) else 1  # scatter/gather or SP: 1/t
    pp_messages = 2 * (v * m + p - 2) if p > 1 else 0
    pp_total = pp_messages * link["pp"].p2p(tokens * model.hidden * act_bytes / split)

    rows = dp_ops(model, c, parts, states, dp_bucket_bytes, per_stage)
    dp_total, dp_exposed = _dp_seconds(
        c,
        link,
        rows,
        parts,
        per_stage,
        dp_bucket_bytes,
        windows,
        overlap=overlap,
        prefetch=prefetch,
    )

    hidden_s = (tp_total - tp_exposed) + (dp_total - dp_exposed)
    hidden_s += (cp_total - cp_exposed) + (ep_total - ep_exposed)
    compute += overlap_cost * hidden_s  # communication kernels slow the compute they hide behind
    time = {"compute": compute, "bubble": bubble, "tp_comm": tp_exposed, "cp_comm": cp_exposed,
            "ep_comm": ep_exposed, "pp_comm": pp_total, "dp_comm": dp_exposed}  # fmt: skip
    time["total"] = sum(time.values())
    hidden = {"tp_comm": tp_total - tp_exposed, "cp_comm": cp_total - cp_exposed,
              "ep_comm": ep_total - ep_exposed, "pp_comm": 0.0,
              "dp_comm": dp_total - dp_exposed}  # fmt: skip
    extra = {"elementwise": elementwise, "efficiency": eff, "dp_rows": rows,
             "dp_messages": sum(r[4] * (m if r[5] == "micro-batch" else 1) for r in rows)}  # fmt: skip
    return time, hidden, extra


def _compute_and_bubble(
    model: Transformer,
    cluster: Cluster,
    choice: Choice,
    tokens: float,
    per_stage: int,
    recompute: str,
    layer_bytes: float,
) -> tuple:
    """``(compute, bubble, elementwise, efficiency)``: seconds of the fullest stage's compute per
    step (its layers, their element-wise work and the head), the bubble, the element-wise part,
    and the efficiency the matrix products run at."""
    c = choice
    L, s, h = model.layers, model.seq_len, model.hidden
    t, p, m = c.tp, c.pp, c.micro_batches
    eff = cluster.matmul_efficiency(tokens) * width_factor(model, t, cluster.half_efficiency_width)
    head = 6 * model.global_batch * s * h * model.vocab
    total_flops = flops_per_step(model, recompute)
    rate = c.n_gpus * cluster.peak_flops * eff
    layer_time = (total_flops - head) / rate * p / L  # one layer's share of the step, per stage
    head_time = head / rate * p  # the last stage also runs the head
    compute = per_stage * layer_time
    elementwise = 0.0
    if cluster.memory_bandwidth:  # memory-bound work between the matrix products
        passes = 5 * (4 / 3 if recompute == "full" else 1)
        elementwise = passes * layer_bytes * per_stage * m / cluster.memory_bandwidth
    compute += elementwise
    frac = theory_bubble(p, m, c.interleave)
    # the fill and drain pass through the other stages, which hold layers only: the slowest stage
    # (the last, with the head) sets the pace of the m micro-batches, the others the bubble
    bubble = compute * frac / (1 - frac)
    compute += head_time
    return compute, bubble, elementwise, eff


def _tp_seconds(
    model: Transformer,
    choice: Choice,
    link: dict,
    tokens: float,
    per_stage: int,
    recompute: str,
    act_bytes: float,
    compute: float,
    overlap: bool,
) -> tuple:
    """``(total, exposed)`` seconds of TP's all-reduces per step; with ``overlap`` all but the
    last hide behind the compute."""
    t = choice.tp
    calls = (6 if recompute == "full" else 4) * per_stage * choice.micro_batches
    total = calls * link["tp"].all_reduce(tokens * model.hidden * act_bytes, t)
    exposed = total
    if overlap and t > 1:
        exposed = max(0.0, total - compute) + total / max(calls, 1)
    return total, exposed


def _cp_seconds(
    model: Transformer,
    choice: Choice,
    link: dict,
    b: float,
    per_stage: int,
    recompute: str,
    act_bytes: float,
    compute: float,
    overlap: bool,
) -> tuple:
    """``(total, exposed)`` seconds of context parallelism's K/V gathers per step; with
    ``overlap`` they hide behind the attention's share of the compute."""
    c, s = choice, model.seq_len
    kv_bytes = b * s * 2 * model.kv * model.head_dim * act_bytes / c.tp  # K and V, per layer
    cp_calls = (3 if recompute == "full" else 2) * per_stage * c.micro_batches
    total = cp_calls * link["cp"].all_gather(kv_bytes, c.cp) if c.cp > 1 else 0.0
    attn_share = (
        4 * s * model.score_width / (2 * model.active_matmul_params() + 4 * s * model.score_width)
    )
    exposed = max(0.0, total - attn_share * compute) if overlap else total
    return total, exposed


def _ep_seconds(
    model: Transformer,
    cluster: Cluster,
    choice: Choice,
    links: dict,
    tokens: float,
    per_stage: int,
    recompute: str,
    sequence_parallel: bool,
    act_bytes: float,
    compute: float,
    overlap: bool,
) -> tuple:
    """``(total, exposed)`` seconds of the MoE layers' all-to-alls per step, the part that leaves
    the node on the network; with ``overlap`` they hide behind the compute."""
    c, h = choice, model.hidden
    t, cp, ep = c.tp, c.cp, c.ep
    total = 0.0
    moe_layers = min(per_stage, model.moe_layers)
    if ep > 1 and moe_layers:
        sp = t if sequence_parallel else 1
        routed = tokens / sp * model.top_k * h * act_bytes  # what one GPU dispatches per layer
        on_node = max(1, cluster.gpus_per_node // (t * cp)) if links["ep"] == "inter" else ep
        off = 1 - min(on_node, ep) / ep  # the part that leaves the node
        one = all_to_all(cluster.intra, routed * (1 - off), min(on_node, ep))
        if off:
            one = max(one, (ep - 1) * cluster.inter.alpha + routed * off / cluster.inter.beta)
        total = (6 if recompute == "full" else 4) * moe_layers * c.micro_batches * one
    exposed = max(0.0, total - compute) if overlap else total
    return total, exposed


def _dp_collective_seconds(
    choice: Choice, link: dict, rows: list[tuple], parts: dict, bucket: float
) -> tuple[dict, dict, float]:
    """Seconds of :func:`dp_ops`'s rows: per phase over the step, FSDP's per layer and
    micro-batch, and the backward's last collective, which nothing after it can hide (the last
    bucket, or FSDP's largest per-layer one)."""
    c, m = choice, choice.micro_batches
    group_n = {"dp": c.shard_degree, "replicate": c.replicas}
    phase = {"forward": 0.0, "backward": 0.0}
    per_layer = {"forward": 0.0, "backward": 0.0}  # FSDP: one layer's collectives per micro-batch
    last = 0.0
    for ph, group, op, nbytes, messages, per in rows:
        ln = link["dp"] if group == "dp" else link["replicate"]
        n = group_n[group]
        if c.ep > 1 and parts["expert"]:  # experts reduce over dp·cp/ep ranks, the rest over all
            share = parts["expert"] / (parts["dense"] + parts["expert"])
            one = collective(ln, op, nbytes * (1 - share), n, messages)
            one += collective(ln, op, nbytes * share, max(1, n // c.ep), messages)
        else:
            one = collective(ln, op, nbytes, n, messages)
        phase[ph] += one * (m if per == "micro-batch" else 1)
        if c.zero == 3:
            per_layer[ph] += one / messages
            if ph == "backward":
                last = max(last, one / messages)
        elif ph == "backward":
            last = collective(ln, op, min(bucket, nbytes), n)
    return phase, per_layer, last


def _dp_seconds(
    choice: Choice,
    link: dict,
    rows: list[tuple],
    parts: dict,
    per_stage: int,
    bucket: float,
    windows: tuple,
    *,
    overlap: bool,
    prefetch: int,
) -> tuple:
    """``(total, exposed)`` seconds of the data-parallel traffic per step: with ``overlap``,
    reductions hide behind backward and gathers behind forward (``windows``: one micro-batch's
    forward and backward seconds), all but the last bucket or layer."""
    c, m = choice, choice.micro_batches
    fwd_window, bwd_window = windows
    phase, per_layer, last = _dp_collective_seconds(c, link, rows, parts, bucket)
    dp_total = phase["forward"] + phase["backward"]
    if not overlap or c.shard_degree * c.replicas == 1:
        dp_exposed = dp_total
    elif c.zero == 3:
        units = max(per_stage, 1)
        # a gather issued ``prefetch`` layers ahead has that many layers' compute to hide behind
        ahead = min(prefetch, units)
        f_l, b_l = ahead * fwd_window / units, ahead * bwd_window / units
        reps = m if c.pp == 1 else 1  # inside a pipeline: once per step
        fwd = units * max(0.0, per_layer["forward"] - f_l) + per_layer["forward"]
        bwd = units * max(0.0, per_layer["backward"] - b_l) + last
        dp_exposed = reps * (fwd + bwd)
    elif c.zero == 2:  # a reduce-scatter per micro-batch, each behind its backward
        dp_exposed = m * max(0.0, phase["backward"] / m - bwd_window) + last
        dp_exposed += max(0.0, phase["forward"] - fwd_window)
    else:  # once per step: behind the last micro-batch's backward and the next forward
        dp_exposed = max(0.0, phase["backward"] - bwd_window) + last
        dp_exposed += max(0.0, phase["forward"] - fwd_window)
    return dp_total, min(dp_exposed, dp_total)


__all__ = ["all_to_all", "collective", "dp_ops", "step_time", "width_factor"]
