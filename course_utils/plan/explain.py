"""A prediction in words: which dimension sits on which link and why, what hides behind compute
and what stays exposed, the ZeRO stage and the memory; and a table of many predictions."""

from __future__ import annotations

import math

from ..pipeline.simulate import theory_bubble
from ..zero import STAGES
from .layouts import Prediction, tie_rule
from .model import GB, Cluster, Transformer

TERMS = ("compute", "bubble", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm")


def _s(x: float) -> str:
    return f"{x:.3g} s"


def _stage(z: int) -> str:
    return ("DDP (no ZeRO)", "ZeRO-1", "ZeRO-2", "ZeRO-3 (FSDP)")[z]


def _hidden(pred: Prediction, key: str) -> str:
    hid = pred.detail["hidden"].get(key, 0.0)
    if not pred.detail.get("overlap", True) or hid <= 0:
        return "exposed"
    shown = pred.time[key]
    return f"{_s(hid)} hidden behind compute, {_s(shown)} exposed"


def _where(pred: Prediction, key: str) -> str:
    return "inside a node" if pred.links[key] == "intra" else "across nodes"


def _headline(pred: Prediction, cluster: Cluster) -> list[str]:
    """The layout, its micro-batches and techniques, the step time, and how the states are kept."""
    c, T, d, g = pred.choice, pred.time, pred.detail, cluster.gpus_per_node
    nodes = math.ceil(c.n_gpus / g)
    v = f", v={c.interleave} chunks per stage" if c.interleave > 1 else ""
    extra = "".join(f" × {k}={getattr(c, k)}" for k in ("cp", "ep") if getattr(c, k) > 1)
    st = d["states"]
    per_param = st["param"] + st["grad"] + st["optim"]
    return [
        f"dp={c.dp} × pp={c.pp} × tp={c.tp}{extra} on {c.n_gpus} GPUs ({nodes} node(s) of {g}), "
        f"m={c.micro_batches} micro-batches of b={d['b']}{v}, {c.family}, recomputation "
        f"{d['recompute']}, attention {d['attention']}, "
        + ("sequence parallelism" if d["sequence_parallel"] else "no sequence parallelism")
        + f": {_s(T['total'])} per step predicted.",
        f"Model states as {st['name']} keeps them: {per_param:g} bytes per parameter "
        f"({st['param']:g} parameter, {st['grad']:g} gradient, {st['optim']:g} optimizer and "
        f"master copy), parameters gathered in {st['gather']:g}-byte and gradients reduced in "
        f"{st['reduce']:g}-byte values.",
    ]


def _tp_line(pred: Prediction, cluster: Cluster) -> str:
    """Where TP's groups sit, the bytes their collectives move, and whether they hide."""
    c, T, d, g = pred.choice, pred.time, pred.detail, cluster.gpus_per_node
    tp_bytes = d["tp_bytes"] / GB
    if c.tp == 1:
        return "TP=1: every GPU computes whole layers; no all-reduce inside a layer."
    if pred.links["tp"] == "intra":
        return (
            f"TP={c.tp} stays inside a node on NVLink"
            + (" with sequence parallelism" if d["sequence_parallel"] else "")
            + f": its collectives after every attention and MLP block move {tp_bytes:.3g} GB per "
            "GPU per step, "
            + (f"{_hidden(pred, 'tp_comm')} (chunked behind the products that feed them)."
               if d["overlaps"]["tp"]
               else f"{_s(T['tp_comm'])}, exposed: the next matrix product waits for each.")
        )  # fmt: skip
    why = f"tp={c.tp} > {g} GPUs per node" if c.tp > g else f"{g} is not a multiple of tp={c.tp}"
    return (
        f"TP={c.tp} crosses nodes ({why}): {tp_bytes:.3g} GB per GPU per step of collectives "
        f"on the inter-node link cost {_s(T['tp_comm'])}, exposed; keep TP within {g} GPUs "
        "if you can."
    )


def _pp_line(pred: Prediction) -> str:
    """The pipeline's link, the layers of a stage and the bubble."""
    c, T, d = pred.choice, pred.time, pred.detail
    if c.pp == 1:
        return "PP=1: no pipeline, so no bubble; every GPU holds all layers."
    where = "across nodes" if pred.links["pp"] == "inter" else "inside a node"
    frac = theory_bubble(c.pp, c.micro_batches, c.interleave)
    return (
        f"PP={c.pp} {where}: a stage boundary only passes b·s·h activations point to point "
        f"({_s(T['pp_comm'])}), which a slow link tolerates; each stage holds "
        f"{d['layers_per_stage']} layer(s). The bubble (p-1)/(v·m+p-1) = {frac:.1%} of the "
        f"step costs {_s(T['bubble'])}."
    )


def _dp_line(pred: Prediction) -> str:
    """The data-parallel group (HSDP's shards and replicas, the experts' ranks), its bytes and
    how much of them hides."""
    c, d = pred.choice, pred.detail
    if c.shard_degree * c.replicas == 1:
        return "DP=1: one replica; no gradient reduction."
    what = "gradients, parameters" if c.zero else "gradients"
    group = f"DP={c.dp}" + (f" × CP={c.cp}" if c.cp > 1 else "")
    if c.replicas > 1:
        group += (
            f", sharded over groups of {c.shard_degree} {_where(pred, 'dp')} and "
            f"all-reduced over {c.replicas} replicas {_where(pred, 'replicate')}"
        )
    else:
        group += f" over the rest, {_where(pred, 'dp')}"
    if c.ep > 1:
        group += f" (the experts' gradients over the {c.shard_degree // c.ep} ranks holding each)"
    return (
        f"{group}: each GPU sends {d['dp_bytes'] / GB:.3g} GB per step ({what}): "
        f"{_hidden(pred, 'dp_comm')}."
    )


def _zero_line(pred: Prediction, model: Transformer) -> str:
    """Why this ZeRO stage: the lowest whose states fit beside the activations, or what to try
    when none does."""
    c, d = pred.choice, pred.detail
    states = d["states_by_stage"]
    acts, limit = pred.memory["activations"], pred.memory["limit"]
    lowest = next((z for z in STAGES if states[z] + acts <= limit), None)
    if lowest is None:
        least = min(STAGES, key=lambda z: states[z])
        tries = ["more GPUs for PP or TP" + (" or CP" if model.seq_len >= 32768 else "")]
        tries += ["recomputation"] if d["recompute"] != "full" else []
        tries += ["a smaller micro-batch"] if d["b"] > 1 else []
        return (
            f"{c.family}: even the smallest states, {_stage(least)}'s {states[least] / GB:.1f} GB, "
            f"leave no room for the activations; try {'; '.join(tries)}."
        )
    if c.zero == 0:
        return f"ZeRO off: the replicated model states ({states[0] / GB:.1f} GB) fit."
    if lowest == c.zero:
        lower = ", ".join(f"{_stage(z)} {states[z] / GB:.1f} GB" for z in range(lowest))
        return (
            f"ZeRO-{c.zero} ({STAGES[c.zero]}) because with less sharding the states would not "
            f"fit beside {acts / GB:.1f} GB of activations in {limit / GB:.1f} GB ({lower}); with "
            f"it they take {states[c.zero] / GB:.1f} GB."
        )
    if states[c.zero] > states[lowest]:
        return (
            f"{c.family}, although {_stage(lowest)} would fit with fewer bytes "
            f"({states[lowest] / GB:.1f} against {states[c.zero] / GB:.1f} GB of states"
            + (": inside a pipeline FSDP keeps the stage gathered" if c.pp > 1 and c.zero == 3
               else "")
            + "): as fast within the model's error, not chosen for memory."
        )  # fmt: skip
    return (
        f"{c.family}, although {_stage(lowest)} would already fit ({states[lowest] / GB:.1f} "
        f"GB of states): the higher stage saves memory, not time."
    )


def _memory_and_step_lines(pred: Prediction) -> list[str]:
    """Memory per GPU, term by term, and the step's exposed and hidden seconds."""
    T, d, mem = pred.time, pred.detail, pred.memory
    hidden = {k: v for k, v in d["hidden"].items() if v > 0}
    return [
        f"Memory per GPU: states {mem['model_states'] / GB:.1f} GB + activations "
        f"{mem['activations'] / GB:.1f} GB (recomputation {d['recompute']}) = "
        f"{mem['total'] / GB:.1f} GB of {mem['limit'] / GB:.1f} GB usable.",
        "Step, exposed: "
        + ", ".join(f"{key} {_s(T[key])}" for key in TERMS)
        + (
            "; hidden behind compute: " + ", ".join(f"{k} {_s(v)}" for k, v in hidden.items())
            if hidden
            else "; nothing hidden"
        )
        + f". Compute runs at {d['efficiency']:.0%} of peak at this micro-batch and TP width.",
    ]


def _cp_ep_overlap_lines(pred: Prediction) -> list[str]:
    """Context and expert parallelism where used, and the overlaps the run had."""
    c, d, lines = pred.choice, pred.detail, []
    if c.cp > 1:
        lines.append(f"CP={c.cp} ({pred.links['cp']}): each sequence split {c.cp} ways, K and V "
                     f"gathered per layer: {_hidden(pred, 'cp_comm')}.")  # fmt: skip
    if c.ep > 1:
        lines.append(f"EP={c.ep} ({pred.links['ep']}): each MoE layer's experts split {c.ep} ways, "
                     f"tokens sent by all-to-all: {_hidden(pred, 'ep_comm')}.")  # fmt: skip
    on = [k.upper() for k, v in d["overlaps"].items() if v]
    if on:
        lines.append(f"Overlapped as the run had it: {', '.join(on)} communication behind the "
                     "computation that feeds it.")  # fmt: skip
    return lines


def _tie_line(pred: Prediction, cluster: Cluster) -> str:
    """Whether the layout is an equal of the fastest, and the rule that orders equals."""
    rule = tie_rule(cluster)[1]
    if pred.tied:
        return f"Within 5% of the fastest layout that fits, an equal, ordered by a rule: {rule}."
    return f"Layouts within 5% of the fastest would be equals, ordered by a rule: {rule}."


def explain(pred: Prediction, model: Transformer, cluster: Cluster) -> str:
    """The choice in the lectures' terms: which dimension sits on which link and why, which
    communication hides behind compute and which is exposed, ZeRO, memory."""
    lines = _headline(pred, cluster)
    lines += [_tp_line(pred, cluster), _pp_line(pred), _dp_line(pred), _zero_line(pred, model)]
    lines += _memory_and_step_lines(pred)
    lines += _cp_ep_overlap_lines(pred)
    lines.append(_tie_line(pred, cluster))
    if pred.reasons:
        lines.append("Does not fit or is invalid: " + "; ".join(pred.reasons) + ".")
    return "\n".join(lines)


def table(preds: list[Prediction], limit: int | None = None) -> str:
    """A markdown table of predictions, one row each."""
    head = ["dp", "pp", "tp", "cp", "ep", "zero", "m", "b", "v", "recompute", "memory GB",
            "step s", *TERMS, "fits"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + ":---:|"]
    for p in preds[:limit]:
        c = p.choice
        cells = [c.dp, c.pp, c.tp, c.cp, c.ep, c.family, c.micro_batches, p.detail["b"],
                 c.interleave, p.detail["recompute"]]  # fmt: skip
        cells += [
            f"{p.memory['total'] / GB:.1f}",
            f"{p.time['total']:.3g}" + (" ≈" if p.tied else ""),
        ]
        cells += [f"{p.time[key]:.3g}" for key in TERMS] + ["yes" if p.fits else "no"]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


__all__ = ["explain", "table"]
