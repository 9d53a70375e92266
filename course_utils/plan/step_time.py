"""Time per step: compute at a compute-only efficiency, the bubble, and each dimension's
communication, split into what hides behind compute and what stays exposed.

- **compute**: :func:`~.model.flops_per_step` on all GPUs at ``peak · efficiency(b·s)``, times
  ``⌈L/(p·v)⌉·p·v/L`` when the stages are uneven (the fullest sets the pace); plus the element-wise
  operations between the matrix products, bound by memory bandwidth: each byte a layer keeps for
  backward crosses the GPU's memory about five times (written and read again in forward, read in
  backward, its gradient written and read): ``5 ·`` the layer's activation bytes per micro-batch
  (a third more with full recomputation, whose forward runs twice).
- **bubble**: 1F1B idles ``(p-1)/(m+p-1)`` of the step, i.e. ``compute · (p-1)/m``; interleaving
  ``v`` chunks divides it by ``v`` (Narayanan et al. 2021, §2.2).
- **tp**: Megatron's four all-reduces of ``b·s·h`` values per layer and micro-batch (six with full
  recomputation), sequence parallelism's all-gather/reduce-scatter pairs cost the same. Exposed:
  the next matrix product waits for each one (overlap only with ``tp_overlap``, Megatron-Core's
  ``--tp-comm-overlap``, which hides them behind the chunked matrix products that feed them).
- **pp**: per micro-batch an activation forward and its gradient back across each boundary,
  ``b·s·h/t`` values per GPU (the ``t`` ranks of a stage each send ``1/t``: Megatron's
  scatter/gather, or sequence parallelism); ``2·(v·m + p - 2)`` messages on the critical path.
- **dp**: the gradients of one shard over ``d`` (plain DP: all-reduce; ZeRO-1/2: reduce-scatter,
  then the parameters all-gathered; ZeRO-3: per micro-batch the parameters all-gathered for forward
  and backward and the gradients reduce-scattered, or once per step inside a pipeline, whose
  stages keep their parameters gathered, as torch's pipelining with FSDP does). With ``overlap``
  (the default) buckets go out while backward computes the earlier layers, so the reduction hides
  behind the last micro-batch's backward, except the last bucket, which can only start when
  backward ends (the Ultra-Scale Playbook's condition: exposed = max(0, comm - window) + last
  bucket); ZeRO's parameter all-gather hides behind the next forward the same way, ZeRO-3's are
  prefetched one layer ahead.
"""

from __future__ import annotations

from ..pipeline.simulate import theory_bubble
from .model import Choice, Cluster, Transformer, flops_per_step, layers_per_stage


def _dp_ops(psi: float, choice: Choice, param_bytes: float, grad_bytes: float) -> dict:
    """Per phase, ``[(collective, calls per step, bytes)]`` of the data-parallel traffic."""
    m, g, p = choice.micro_batches, psi * grad_bytes, psi * param_bytes
    if choice.zero == 0:
        return {"backward": [("all_reduce", 1, g)], "forward": []}
    if choice.zero == 1:
        return {"backward": [("reduce_scatter", 1, g)], "forward": [("all_gather", 1, p)]}
    if choice.zero == 2:
        return {"backward": [("reduce_scatter", m, g)], "forward": [("all_gather", 1, p)]}
    if choice.pp > 1:  # gathered once, kept through the micro-batches, reduced once
        return {"backward": [("reduce_scatter", 1, g)], "forward": [("all_gather", 1, p)]}
    return {"backward": [("reduce_scatter", m, g), ("all_gather", m, p)],
            "forward": [("all_gather", m, p)]}  # fmt: skip


def step_time(
    model: Transformer,
    cluster: Cluster,
    choice: Choice,
    b: float,
    links: dict,
    psi: float,
    *,
    recompute: str,
    sequence_parallel: bool,
    act_bytes: float,
    param_bytes: float,
    grad_bytes: float,
    overlap: bool,
    tp_overlap: bool,
    dp_bucket_bytes: float,
    layer_bytes: float = 0.0,
    overlap_cost: float = 0.0,
    pp_scatter_gather: bool = True,
) -> tuple[dict, dict]:
    """``(time, hidden)``: seconds per step of each exposed term (and their ``total``), and the
    seconds of communication each term hid behind compute."""
    L, s, h = model.layers, model.seq_len, model.hidden
    t, p, m, v, d = choice.tp, choice.pp, choice.micro_batches, choice.interleave, choice.dp
    link = {k: cluster.intra if links[k] == "intra" else cluster.inter for k in links}
    per_stage = layers_per_stage(model, choice)
    eff = cluster.matmul_efficiency(b * s)
    compute = flops_per_step(model, recompute) / (choice.n_gpus * cluster.peak_flops * eff)
    compute *= per_stage * p / L  # the fullest stage sets the pace
    elementwise = 0.0
    if cluster.memory_bandwidth:  # memory-bound work between the matrix products
        passes = 5 * (4 / 3 if recompute == "full" else 1)
        elementwise = passes * layer_bytes * per_stage * m / cluster.memory_bandwidth
    compute += elementwise
    frac = theory_bubble(p, m, v)
    bubble = compute * frac / (1 - frac)

    # one micro-batch's forward and backward on this GPU (the windows communication can hide in)
    passes = {"none": 3, "selective": 3, "full": 4}[recompute]
    per_micro = compute / m
    fwd_window, bwd_window = per_micro / passes, per_micro * (passes - 1) / passes

    calls = (6 if recompute == "full" else 4) * per_stage * m
    tp_total = calls * link["tp"].all_reduce(b * s * h * act_bytes, t)
    tp_exposed = tp_total
    if tp_overlap and t > 1:
        tp_exposed = max(0.0, tp_total - compute) + tp_total / max(calls, 1)

    split = t if (sequence_parallel or pp_scatter_gather) else 1  # scatter/gather or SP: 1/t
    pp_messages = 2 * (v * m + p - 2) if p > 1 else 0
    pp_total = pp_messages * link["pp"].p2p(b * s * h * act_bytes / split)

    ops = _dp_ops(psi, choice, param_bytes, grad_bytes)
    cost = {ph: sum(n * getattr(link["dp"], op)(x, d) for op, n, x in ops[ph]) for ph in ops}
    dp_total = cost["backward"] + cost["forward"]
    if not overlap or d == 1:
        dp_exposed = dp_total
    else:
        bucket = min(dp_bucket_bytes, psi * grad_bytes)
        last = (
            link["dp"].all_reduce(bucket, d)
            if choice.zero == 0
            else link["dp"].reduce_scatter(bucket, d)
        )
        if (
            choice.zero == 3 and p == 1
        ):  # every micro-batch: gathers prefetched, reductions in backward
            per_fwd, per_bwd = cost["forward"] / m, cost["backward"] / m
            dp_exposed = (
                m * (max(0.0, per_fwd - fwd_window) + max(0.0, per_bwd - bwd_window)) + last
            )
        elif choice.zero == 2:  # a reduce-scatter per micro-batch, each behind its backward
            per_bwd = cost["backward"] / m
            dp_exposed = m * max(0.0, per_bwd - bwd_window) + last
            dp_exposed += max(0.0, cost["forward"] - fwd_window)
        else:  # once per step: behind the last micro-batch's backward and the next forward
            dp_exposed = max(0.0, cost["backward"] - bwd_window) + last
            dp_exposed += max(0.0, cost["forward"] - fwd_window)
        dp_exposed = min(dp_exposed, dp_total)

    hidden_s = (tp_total - tp_exposed) + (dp_total - dp_exposed)
    compute += overlap_cost * hidden_s  # communication kernels slow the compute they hide behind
    time = {"compute": compute, "bubble": bubble, "tp_comm": tp_exposed, "pp_comm": pp_total,
            "dp_comm": dp_exposed}  # fmt: skip
    time["total"] = sum(time.values())
    hidden = {"tp_comm": tp_total - tp_exposed, "pp_comm": 0.0, "dp_comm": dp_total - dp_exposed,
              "elementwise": elementwise}  # fmt: skip
    return time, hidden


__all__ = ["step_time"]
