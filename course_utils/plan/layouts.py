"""Every layout of ``n`` GPUs, checked, placed on the links, predicted and ranked.

**Placement**: Megatron-Core's order, TP innermost, then CP, then DP, PP outermost:
``rank = ((pp_idx·dp + dp_idx)·cp + cp_idx)·tp + tp_idx``; expert parallelism is carved out of
the ``dp × cp`` ranks (consecutive ones first), HSDP's shard groups are the inner part of
``dp``. A dimension's groups use the ``intra`` link when each lies on one node, else ``inter``: a
ring with one inter-node hop runs at the slower link's speed.

**Ranking**: layouts that fit first; among them, those whose TP groups stay inside a node before
those whose TP crosses nodes; then the fastest. Layouts within ``tolerance`` of the fastest (5%,
the model's own uncertainty for a comparison: see :data:`TIE_TOLERANCE`) are *equals*, marked
``tied`` and ordered by the practitioner's rule of :func:`tie_rule`: on a fast network, the
fewest pipeline stages (TP up to the node first, as Narayanan et al. advise), then the least TP
and CP, the lower ZeRO stage and no interleaving; on a slow one, the least TP and CP, then the
fewest bytes per GPU across it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from ..comm.ledger import ring_bytes
from ..tensor_parallel.measure import megatron_bytes_per_layer
from .memory import activations, layer_activation_bytes, model_states, state_bytes
from .model import (
    GB,
    RECOMPUTE,
    Choice,
    Cluster,
    Transformer,
    _recompute_mode,
    layers_per_stage,
)
from .step_time import step_time

TIE_TOLERANCE = 0.05
"""Layouts within 5% of the fastest are equals. Against Megatron-LM's Table 1 the planner's
absolute times spread over about 15% (``test_narayanan_table1_layouts_predicted_within_20_percent``);
two layouts of one model on one cluster share most of those errors (the same efficiency, the same
links), so a difference below 5% says nothing about which is faster."""

SLOW_NETWORK = 25e9
"""Bytes per second per GPU across nodes below which the network is slow for the tie rule:
HDR InfiniBand with one 200 Gb/s port per GPU (25 GB/s) and faster is fast; BLOOM's Omni-Path,
4 × 100 Gb/s per 8 GPUs (6.25 GB/s per GPU), is slow."""


@dataclass
class Prediction:
    """What :func:`predict` says about one :class:`~.model.Choice`."""

    choice: Choice
    memory: dict
    """Bytes per GPU: ``model_states``, ``activations``, ``total``, and the usable ``limit``."""
    time: dict
    """Seconds per step, exposed: ``compute``, ``bubble``, ``tp_comm``, ``cp_comm``, ``ep_comm``,
    ``pp_comm``, ``dp_comm``, ``total``."""
    links: dict
    """``{"tp": "intra" | "inter", "cp": ..., "ep": ..., "dp": ..., "replicate": ..., "pp": ...}``
    as placed."""
    fits: bool
    reasons: list[str]
    """Why it does not fit or is invalid, with the numbers; empty when it fits."""
    detail: dict = field(default_factory=dict)
    """``b``, ``params_per_gpu``, ``layers_per_stage``, ``recompute``, ``attention``,
    ``sequence_parallel``, ``states_by_stage``, ``hidden`` (seconds each communication term hid),
    ``tp_bytes``, ``dp_bytes``, ``states`` (bytes per parameter), ``inter_bytes``, ...;
    ``states_by_stage``: each ZeRO stage's model states for this layout, each with its framework's
    bytes per parameter unless ``states`` was given."""
    tied: bool = False
    """Within :data:`TIE_TOLERANCE` of the fastest layout that fits: an equal, ordered by the tie
    rule, not by time."""


def problems(model: Transformer, choice: Choice, n_gpus: int | None = None) -> list[str]:
    """Why ``choice`` is not a valid layout of ``model`` (on ``n_gpus``), in words with numbers."""
    c, out = choice, []
    if n_gpus is not None and c.n_gpus != n_gpus:
        out.append(f"dp={c.dp} × pp={c.pp} × tp={c.tp} = {c.n_gpus}, but n_gpus is {n_gpus}")
    sizes = {"heads": model.heads, "hidden": model.hidden, "ffn": model.ffn}
    if model.kv_heads is not None:
        sizes["kv_heads"] = model.kv
    if model.vocab_multiple == 1:  # unpadded: t must split the vocabulary itself
        sizes["vocab"] = model.vocab
    for name, size in sizes.items():
        if size % c.tp:
            out.append(f"{name}={size} is not divisible by tp={c.tp}")
    if model.seq_len % (2 * c.cp) and c.cp > 1:
        out.append(f"seq_len={model.seq_len} is not divisible by 2·cp={2 * c.cp} (context "
                   "parallelism cuts each sequence into 2·cp chunks to balance causal attention)")  # fmt: skip
    if c.ep > 1:
        if not model.moe:
            out.append(f"ep={c.ep} but {model.name or 'the model'} has no experts")
        elif model.experts % c.ep:
            out.append(f"experts={model.experts} is not divisible by ep={c.ep}")
        if (c.dp * c.cp) % c.ep:
            out.append(f"ep={c.ep} must divide dp·cp={c.dp * c.cp}: experts are split over the "
                       "data- and context-parallel ranks")  # fmt: skip
    chunks = c.pp * c.interleave
    if model.layers < chunks:
        out.append(f"layers={model.layers} < pp={c.pp} × v={c.interleave}: a stage chunk would "
                   "have no layer")  # fmt: skip
    if c.interleave > 1 and (c.pp == 1 or c.micro_batches % c.pp):
        out.append(f"interleaving v={c.interleave} needs pp > 1 and m={c.micro_batches} a "
                   f"multiple of pp={c.pp}")  # fmt: skip
    if model.global_batch % (c.dp * c.micro_batches):
        out.append(
            f"global batch {model.global_batch} is not divisible by dp={c.dp} × "
            f"m={c.micro_batches} = {c.dp * c.micro_batches}"
        )
    return out


@lru_cache(maxsize=8192)
def _placement(dp: int, pp: int, tp: int, gpus_per_node: int, cp: int = 1, ep: int = 1,
               shard: int = 0) -> tuple:  # fmt: skip
    shard = shard or dp
    node = np.arange(dp * cp * pp * tp).reshape(pp, dp // shard, shard, cp, tp) // gpus_per_node

    def where(groups):  # groups: one row per group
        return "intra" if (groups.max(axis=1) == groups.min(axis=1)).all() else "inter"

    def rows(axes):
        rest = [a for a in range(5) if a not in axes]
        moved = np.transpose(node, rest + list(axes))
        return moved.reshape(-1, int(np.prod([node.shape[a] for a in axes])))

    experts = node.reshape(pp, dp * cp // ep, ep, tp)  # ep consecutive (dp, cp) ranks
    return (
        ("tp", where(rows([4]))),
        ("cp", where(rows([3]))),
        ("ep", where(np.transpose(experts, (0, 1, 3, 2)).reshape(-1, ep))),
        ("dp", where(rows([2, 3]))),  # the shard group: dp (or HSDP's shard) × cp
        ("replicate", where(rows([1]))),
        ("pp", where(rows([0]))),
    )


def placement(choice: Choice, gpus_per_node: int) -> dict:
    """Which link each dimension's groups use: ``{"tp": "intra", "cp": ..., "ep": ..., "dp": ...,
    "replicate": ..., "pp": "inter"}`` (``dp``: the group the states are sharded over, ``dp × cp``
    or HSDP's shard groups × ``cp``; ``replicate``: HSDP's replicas)."""
    c = choice
    return dict(_placement(c.dp, c.pp, c.tp, gpus_per_node, c.cp, c.ep, c.shard))


def predict(
    model: Transformer,
    cluster: Cluster,
    choice: Choice,
    *,
    states: str | None = None,
    param_bytes: float | None = None,
    grad_bytes: float | None = None,
    k: float | None = None,
    act_bytes: float = 2,
    mask_bytes: float = 1,
    sequence_parallel: bool | None = None,
    recompute: bool | str = "none",
    attention: str = "flash",
    overlap: bool = True,
    overlap_cost: float = 0.2,
    tp_overlap: bool = False,
    cp_overlap: bool = False,
    ep_overlap: bool = False,
    pp_scatter_gather: bool = True,
    memory_headroom: float = 0.9,
    dp_bucket_bytes: float = 25 * 2**20,
    prefetch: int = 1,
    n_gpus: int | None = None,
) -> Prediction:
    """Memory per GPU and seconds per step of ``choice``.

    ``states``: how the framework keeps parameters, gradients and optimizer state
    (:data:`~.memory.STATES`): ``"megatron"`` (bf16 parameters, fp32 gradients, fp32 master and
    Adam: 18 bytes per parameter, gradients reduced in fp32), ``"fsdp"`` (FSDP2 as torchtitan runs
    it: 16 bytes, all sharded, gathered in bf16, reduced in fp32) or ``"zero"`` (the ZeRO paper's
    16: 2 + 2 + 12). Default: ``"fsdp"`` for ``zero=3``, ``"megatron"`` otherwise.
    ``param_bytes``/``grad_bytes``/``k`` override its numbers.
    ``sequence_parallel``: ``None`` = on whenever ``tp > 1``. ``recompute``: ``"none"``,
    ``"selective"`` or ``"full"`` (``True``/``False`` for full/none). ``attention``: ``"flash"``
    (scores never stored) or ``"materialized"`` (before FlashAttention, 2022). ``overlap``:
    communication hides behind compute where it can (``False``: every term added, an upper bound);
    ``overlap_cost``: the fraction of every hidden second added to compute (communication kernels
    take SMs and memory bandwidth from the computation they overlap; notebook 04 measured that
    overlap is not free). ``tp_overlap``: TP's collectives hidden behind the matrix products that
    feed them (Megatron-Core's ``--tp-comm-overlap``, torchtitan's async TP). ``cp_overlap``: the
    context-parallel K/V transfers hidden behind attention (a ring). ``ep_overlap``: the expert
    all-to-alls hidden behind another micro-batch's compute (DeepSeek's DualPipe).
    ``pp_scatter_gather``: the ``t`` ranks of a stage each send ``1/t`` of the activation
    (Megatron-LM's optimisation; implied by sequence parallelism). ``prefetch``: FSDP's layers
    gathered ahead of the one computing (1, FSDP2's default; more hides more latency and holds more
    memory). ``dp_bucket_bytes``: DDP's and ZeRO-1/2's gradient buckets, each a message.

    An invalid choice still gets numbers (with a fractional ``b`` if need be), ``fits=False`` and
    the reasons; ``n_gpus`` adds the check that the layout uses exactly that many GPUs."""
    c = choice
    mode = _recompute_mode(recompute)
    sp = (c.tp > 1) if sequence_parallel is None else bool(sequence_parallel)
    reasons = problems(model, c, n_gpus)
    b = _micro_batch_size(model, c)
    per_param, st, memory, detail = _memory_per_gpu(
        model, cluster, c, b, reasons, states=states, prefetch=prefetch,
        override={"param_bytes": param_bytes, "grad_bytes": grad_bytes, "k": k},
        headroom=memory_headroom, sequence_parallel=sp, recompute=mode, act_bytes=act_bytes,
        mask_bytes=mask_bytes, attention=attention,
    )  # fmt: skip
    links = placement(c, cluster.gpus_per_node)
    layer_bytes = layer_activation_bytes(model, b, c.tp, sp, act_bytes, mask_bytes, attention,
                                         "none", c.cp, model.moe)  # fmt: skip
    time, hidden, extra = step_time(
        model, cluster, c, b, links, st, per_param, recompute=mode, sequence_parallel=sp,
        act_bytes=act_bytes, overlap=overlap, tp_overlap=tp_overlap, cp_overlap=cp_overlap,
        ep_overlap=ep_overlap, dp_bucket_bytes=dp_bucket_bytes, layer_bytes=layer_bytes,
        overlap_cost=overlap_cost if overlap else 0.0, pp_scatter_gather=pp_scatter_gather,
        prefetch=prefetch,
    )  # fmt: skip
    detail.update(
        hidden=hidden, elementwise=extra["elementwise"], overlap=overlap,
        overlaps={"tp": tp_overlap, "cp": cp_overlap, "ep": ep_overlap},
        efficiency=extra["efficiency"],
        **_traffic_bytes(model, c, b, mode, links, extra, act_bytes),
    )  # fmt: skip
    return Prediction(c, memory, time, links, not reasons, reasons, detail)


def _micro_batch_size(model: Transformer, choice: Choice) -> float:
    """``b = B / (dp · m)``: an int when it divides, else the fraction (an invalid layout)."""
    b = model.global_batch / (choice.dp * choice.micro_batches)
    return int(b) if b == int(b) else b


def _memory_per_gpu(
    model: Transformer,
    cluster: Cluster,
    choice: Choice,
    b: float,
    reasons: list[str],
    *,
    states: str | None,
    override: dict,
    prefetch: int,
    headroom: float,
    sequence_parallel: bool,
    recompute: str,
    act_bytes: float,
    mask_bytes: float,
    attention: str,
) -> tuple[dict, dict, dict, dict]:
    """``(per_param, st, memory, detail)`` of :func:`predict`: the bytes per parameter, one
    shard's model states, :attr:`Prediction.memory` and the memory half of
    :attr:`Prediction.detail`. Appends to ``reasons`` when the layout does not fit."""
    c = choice
    per_param = state_bytes(c, states, **override)
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1 layer, not {prefetch!r}")
    st = model_states(model, c, states=per_param, prefetch=prefetch)
    acts = activations(model, c, b, sequence_parallel=sequence_parallel, act_bytes=act_bytes,
                       mask_bytes=mask_bytes, attention=attention, recompute=recompute)  # fmt: skip
    act = max(acts["first"], acts["last"])
    state = st["by_stage"][c.zero]
    total = state + act
    limit = headroom * cluster.memory_bytes
    if total > limit:
        reasons.append(
            f"needs {total / GB:.1f} GB per GPU (model states {state / GB:.1f} + "
            f"activations {act / GB:.1f}) but {headroom:.0%} of "
            f"{cluster.memory_bytes / GB:.0f} GB is {limit / GB:.1f} GB"
        )
    detail = {
        "b": b,
        "params_per_gpu": st["psi"],
        "expert_params_per_gpu": st["expert"],
        "layers_per_stage": layers_per_stage(model, c),
        "recompute": recompute,
        "attention": attention,
        "sequence_parallel": sequence_parallel,
        "states": per_param,
        "states_by_stage": _states_by_stage(model, c, st, states, override, prefetch),
        "activations_first": acts["first"],
        "activations_last": acts["last"],
        "logits": acts["logits"],
    }
    memory = {"model_states": state, "activations": act, "total": total, "limit": limit}
    return per_param, st, memory, detail


def _states_by_stage(model: Transformer, choice: Choice, st: dict, states: str | None,
                     override: dict, prefetch: int) -> list[float]:  # fmt: skip
    """Each ZeRO stage's model states for this layout (``st``'s for its own stage), each with its
    framework's bytes per parameter unless ``states`` was given: what :func:`explain` weighs
    when it says why this stage."""
    c = choice
    return [
        st["by_stage"][z]
        if z == c.zero
        else model_states(
            model,
            replace(c, zero=z, reshard=True, shard=0),
            states=state_bytes(replace(c, zero=z, reshard=True, shard=0), states, **override),
            prefetch=prefetch,
        )["by_stage"][z]
        for z in range(4)
    ]


def _traffic_bytes(model: Transformer, choice: Choice, b: float, mode: str, links: dict,
                   extra: dict, act_bytes: float) -> dict:  # fmt: skip
    """Bytes per GPU per step: TP's collectives, DP's (with its message count) and all that
    crosses the inter-node network (what the slow-network tie rule weighs)."""
    c = choice
    per_stage = layers_per_stage(model, c)
    calls = (6 if mode == "full" else 4) * per_stage * c.micro_batches
    m = c.micro_batches
    dp_bytes = sum(
        ring_bytes(op, x, c.shard_degree if g == "dp" else c.replicas) * (m if per != "step" else 1)
        for _, g, op, x, _, per in extra["dp_rows"]
    )
    tp_bytes = megatron_bytes_per_layer(b / c.cp, model.seq_len, model.hidden, c.tp,
                                        act_bytes) * calls / 4  # fmt: skip
    inter = 0.0  # bytes per GPU per step on the inter-node network (the slow-network tie rule)
    if links["dp"] == "inter":
        inter += dp_bytes
    if links["tp"] == "inter":
        inter += tp_bytes
    if links["pp"] == "inter" and c.pp > 1:
        inter += 2 * m * b * model.seq_len / c.cp * model.hidden * act_bytes / c.tp
    return {"tp_bytes": tp_bytes, "dp_bytes": dp_bytes, "dp_messages": extra["dp_messages"],
            "inter_bytes": inter}  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_choices(
    model: Transformer,
    n_gpus: int,
    *,
    zero_stages=(0, 1, 2, 3),
    micro_batches=None,
    interleave=(1,),
    context=(1,),
    experts=None,
    fsdp=((True, 0),),
    gpus_per_node: int | None = None,
) -> list[Choice]:
    """Every valid layout on exactly ``n_gpus``: ``tp`` divides heads, hidden and the MLP (and the
    vocabulary when it is not padded); ``pp·v ≤ L`` (uneven splits allowed, the fullest stage
    charged); ``dp · m`` divides ``B``; ``ep`` divides the experts and ``dp·cp``.

    ``micro_batches``: the ``m`` to try (default: every ``m`` that divides ``B/dp``).
    ``interleave``: the ``v`` to try (interleaved 1F1B needs ``m`` a multiple of ``p``).
    ``context``: the ``cp`` to try. ``experts``: the ``ep`` to try (default: every valid one for
    a MoE model, 1 for a dense one). ``fsdp``: the ``(reshard, shard)`` variants of ZeRO-3 to try;
    ``shard="node"`` is HSDP sharded over one node's data-parallel ranks (``gpus_per_node/(tp·cp)``).
    ZeRO stages above 0 are skipped when ``dp·cp = 1``: there is nothing to shard over."""
    out = []
    for cp in context:
        if n_gpus % cp:
            continue
        for tp in _divisors(n_gpus // cp):
            for pp in _divisors(n_gpus // (cp * tp)):
                dp = n_gpus // (cp * tp * pp)
                if model.global_batch % dp:
                    continue
                eps = experts or (
                    [e for e in _divisors(dp * cp) if model.experts % e == 0] if model.moe else (1,)
                )
                for m in micro_batches or _divisors(model.global_batch // dp):
                    for v in interleave if pp > 1 else (1,):
                        for ep in eps:
                            for z in zero_stages if dp * cp > 1 else (0,):
                                for reshard, shard in fsdp if z == 3 else ((True, 0),):
                                    if shard == "node":  # HSDP: shard within one node
                                        shard = (gpus_per_node or 0) // (tp * cp)
                                        if shard < 2:
                                            continue
                                    if shard and (shard >= dp or dp % shard):
                                        continue
                                    if z == 3 and pp > 1:  # a pipeline's stage stays gathered
                                        reshard = False
                                    if (
                                        z == 2 and pp > 1
                                    ):  # DeepSpeed refuses it; Megatron has no ZeRO-2
                                        continue
                                    choice = Choice(dp, pp, tp, z, m, v, cp, ep, reshard, shard)
                                    if not problems(model, choice, n_gpus):
                                        out.append(choice)
    return list(dict.fromkeys(out))


def _rank(pred: Prediction) -> tuple:
    # fitting first; TP inside a node before TP across nodes; then the fastest; equal times
    # (ZeRO-1's RS + AG is plain DP's all-reduce) to the simpler, smaller layout
    return (
        not pred.fits,
        pred.choice.tp > 1 and pred.links["tp"] == "inter",
        float(f"{pred.time['total']:.9g}"),
        pred.choice.zero,
        pred.memory["total"],
    )


def best_of(preds) -> Prediction:
    return min(preds, key=_rank)


def tie_rule(cluster: Cluster) -> tuple:
    """``(key, words)``: how equals are ordered on this cluster, and the rule in words.

    A practitioner's rule. On a **fast** inter-node network (at least :data:`SLOW_NETWORK` per
    GPU), Narayanan et al.'s (2021, §3.3, takeaway 1): tensor parallelism up to the node before a
    pipeline, so the fewest pipeline stages (no bubble to tune), then the least TP, then the
    least CP, then the lower ZeRO stage, then no interleaving. On a **slow** one, the least model
    parallelism inside each layer first: the least TP, then the least CP, then the fewest bytes per
    GPU across the network (rounded to 1 GB), which favours more pipeline stages (they send only
    activations), then the fewest stages (BLOOM's TP 4 × PP 12 on Omni-Path)."""
    if cluster.inter.beta >= SLOW_NETWORK:

        def key(p):
            c = p.choice
            return (c.pp, c.tp, c.cp, c.zero, c.interleave, p.time["total"])

        words = (f"the network between nodes is fast ({cluster.inter.beta / 1e9:.3g} GB/s per "
                 "GPU): among equals, TP up to the node before a pipeline, so the fewest "
                 "pipeline stages, then the least TP, then the least CP, then the lower ZeRO "
                 "stage, then no interleaving")  # fmt: skip
    else:

        def key(p):
            c = p.choice
            return (c.tp, c.cp, round(p.detail["inter_bytes"] / 1e9), c.pp, c.zero,
                    p.time["total"])  # fmt: skip

        words = (f"the network between nodes is slow ({cluster.inter.beta / 1e9:.3g} GB/s per "
                 "GPU): among equals, the least TP, then the least CP, then the fewest bytes per "
                 "GPU across the network (to 1 GB), then the fewest pipeline stages")  # fmt: skip
    return key, words


def _ties_first(ranked: list[Prediction], cluster: Cluster, tolerance: float) -> list[Prediction]:
    good = [p for p in ranked if p.fits and not (p.choice.tp > 1 and p.links["tp"] == "inter")]
    if not good or tolerance <= 0:
        return ranked
    fastest = good[0].time["total"]
    near = [p for p in good if p.time["total"] <= (1 + tolerance) * fastest]
    key, _ = tie_rule(cluster)
    near.sort(key=key)
    for p in near:
        p.tied = len(near) > 1
    chosen = {id(p) for p in near}
    return near + [p for p in ranked if id(p) not in chosen]


def plan(
    model: Transformer,
    cluster: Cluster,
    n_gpus: int,
    *,
    tolerance: float = TIE_TOLERANCE,
    **kw,
) -> list[Prediction]:
    """Every valid layout on ``n_gpus``, predicted and ranked (see the module's doc).

    ``zero_stages``, ``micro_batches``, ``interleave`` (default ``(1, 2, 4)`` chunks per stage),
    ``context`` (default: ``cp`` of 1 for sequences under 32K tokens, up to 16 above), ``experts``
    and ``fsdp`` (default: FSDP, FSDP without resharding after forward, and HSDP sharded within a
    node) go to :func:`valid_choices`, the rest to :func:`predict`. Without ``recompute`` the
    planner tries none, selective and full for every layout and keeps the fastest that fits
    (recomputation costs time, so it is chosen only where memory needs it). ``tolerance``: how
    close to the fastest a layout is an equal, ordered by :func:`tie_rule` (0: by time only)."""
    kw.setdefault("interleave", (1, 2, 4))
    if "context" not in kw:
        kw["context"] = (
            (1,) if model.seq_len < 32768 else tuple(c for c in (1, 2, 4, 8, 16) if n_gpus % c == 0)
        )
    kw.setdefault("fsdp", ((True, 0), (False, 0), (True, "node")))
    kw.setdefault("gpus_per_node", cluster.gpus_per_node)
    choose = {
        key: kw.pop(key)
        for key in (
            "zero_stages",
            "micro_batches",
            "interleave",
            "context",
            "experts",
            "fsdp",
            "gpus_per_node",
        )
        if key in kw
    }
    choices = valid_choices(model, n_gpus, **choose)
    if not choices:
        raise ValueError(
            f"no layout of {n_gpus} GPUs is valid for {model.name or model}: tp must divide "
            f"heads={model.heads} (and the MLP, {model.ffn}), pp must be at most layers="
            f"{model.layers}, and dp must divide the global batch {model.global_batch}; try "
            "another GPU count"
        )
    modes = [kw.pop("recompute")] if "recompute" in kw else list(RECOMPUTE)
    out = []
    for c in choices:
        preds = []
        for r in modes:  # recomputation only costs time: stop at the first that fits
            preds.append(predict(model, cluster, c, n_gpus=n_gpus, recompute=r, **kw))
            if preds[-1].fits:
                break
        out.append(best_of(preds))
    return _ties_first(sorted(out, key=_rank), cluster, tolerance)


__all__ = ["SLOW_NETWORK", "TIE_TOLERANCE", "Prediction", "best_of", "placement", "plan",
           "predict", "problems", "tie_rule", "valid_choices"]  # fmt: skip
