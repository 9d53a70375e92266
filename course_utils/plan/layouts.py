"""Every layout of ``n`` GPUs, checked, placed on the links, predicted and ranked.

**Placement**: rank ``= pp_idx·(dp·tp) + dp_idx·tp + tp_idx`` (TP innermost, then DP, PP
outermost: Megatron-Core's order). A dimension's groups use the ``intra`` link when each lies on
one node, else ``inter``: a ring with one inter-node hop runs at the slower link's speed.

**Ranking**: layouts that fit first; among them, those whose TP groups stay inside a node before
those whose TP crosses nodes (a layout with TP on the network is never the top pick while one
without fits); then the fastest; equal times go to the lower ZeRO stage and the smaller memory.
Among the layouts within ``tolerance`` (3%) of the fastest, far inside the model's own error, the
simplest comes first, as practitioners choose: fewer pipeline stages, then no interleaving, then
less tensor parallelism, then a lower ZeRO stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..tensor_parallel.measure import megatron_bytes_per_layer, ring_bytes
from .memory import activations, layer_activation_bytes, model_states
from .model import (
    GB,
    RECOMPUTE,
    Choice,
    Cluster,
    Transformer,
    _recompute_mode,
    layers_per_stage,
)
from .step_time import _dp_ops, step_time


@dataclass
class Prediction:
    """What :func:`predict` says about one :class:`~.model.Choice`."""

    choice: Choice
    memory: dict
    """Bytes per GPU: ``model_states``, ``activations``, ``total``, and the usable ``limit``."""
    time: dict
    """Seconds per step, exposed: ``compute``, ``bubble``, ``tp_comm``, ``pp_comm``, ``dp_comm``,
    ``total``."""
    links: dict
    """``{"tp": "intra" | "inter", "pp": ..., "dp": ...}`` as placed."""
    fits: bool
    reasons: list[str]
    """Why it does not fit or is invalid, with the numbers; empty when it fits."""
    detail: dict = field(default_factory=dict)
    """``b``, ``params_per_gpu``, ``layers_per_stage``, ``recompute``, ``attention``,
    ``sequence_parallel``, ``states_by_stage``, ``hidden`` (seconds each communication term hid),
    ``tp_bytes``, ``dp_bytes``, ..."""


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


@lru_cache(maxsize=4096)
def _placement(dp: int, pp: int, tp: int, gpus_per_node: int) -> tuple:
    node = np.arange(dp * pp * tp).reshape(pp, dp, tp) // gpus_per_node
    return tuple(
        (name, "intra" if (node.max(axis) == node.min(axis)).all() else "inter")
        for name, axis in (("tp", 2), ("dp", 1), ("pp", 0))
    )


def placement(choice: Choice, gpus_per_node: int) -> dict:
    """Which link each dimension's groups use: ``{"tp": "intra", "dp": "intra", "pp": "inter"}``."""
    return dict(_placement(choice.dp, choice.pp, choice.tp, gpus_per_node))


def predict(
    model: Transformer,
    cluster: Cluster,
    choice: Choice,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    k: float = 12,
    act_bytes: float = 2,
    mask_bytes: float = 1,
    sequence_parallel: bool | None = None,
    recompute: bool | str = "none",
    attention: str = "flash",
    overlap: bool = True,
    overlap_cost: float = 0.2,
    tp_overlap: bool = False,
    pp_scatter_gather: bool = True,
    memory_headroom: float = 0.9,
    dp_bucket_bytes: float = 25 * 2**20,
    n_gpus: int | None = None,
) -> Prediction:
    """Memory per GPU and seconds per step of ``choice``.

    ``param_bytes``/``grad_bytes``/``k``: bytes per parameter of the parameters, gradients and
    optimizer state (2/2/12: mixed-precision Adam, 16Ψ; ``grad_bytes=4``: Megatron's fp32
    gradients, 18Ψ). ``sequence_parallel``: ``None`` = on whenever ``tp > 1``. ``recompute``:
    ``"none"``, ``"selective"`` or ``"full"`` (``True``/``False`` for full/none). ``attention``:
    ``"flash"`` (scores never stored) or ``"materialized"``. ``overlap``: communication hides
    behind compute where it can (``False``: every term added, an upper bound); ``overlap_cost``:
    the fraction of every hidden second added to compute (communication kernels take SMs and
    memory bandwidth from the computation they overlap; notebook 04 measured that overlap is not
    free). ``tp_overlap``: TP's collectives hidden behind the matrix products that feed them
    (Megatron-Core's ``--tp-comm-overlap``, torchtitan's async TP); plain TP, as notebook 06 builds
    it, waits for each. ``pp_scatter_gather``: the ``t`` ranks of a stage each send ``1/t`` of the
    activation and all-gather it on arrival (Megatron-LM's optimisation; implied by sequence
    parallelism); ``False``: each sends it whole, as the course's composition does.

    An invalid choice still gets numbers (with a fractional ``b`` if need be), ``fits=False`` and
    the reasons; ``n_gpus`` adds the check that the layout uses exactly that many GPUs."""
    c = choice
    mode = _recompute_mode(recompute)
    sp = (c.tp > 1) if sequence_parallel is None else bool(sequence_parallel)
    reasons = problems(model, c, n_gpus)
    b = model.global_batch / (c.dp * c.micro_batches)
    b = int(b) if b == int(b) else b
    states = model_states(model, c, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
    acts = activations(model, c, b, sequence_parallel=sp, act_bytes=act_bytes,
                       mask_bytes=mask_bytes, attention=attention, recompute=mode)  # fmt: skip
    act = max(acts["first"], acts["last"])
    state = states["by_stage"][c.zero]
    total = state + act
    limit = memory_headroom * cluster.memory_bytes
    if total > limit:
        reasons.append(
            f"needs {total / GB:.1f} GB per GPU (model states {state / GB:.1f} + "
            f"activations {act / GB:.1f}) but {memory_headroom:.0%} of "
            f"{cluster.memory_bytes / GB:.0f} GB is {limit / GB:.1f} GB"
        )
    links = placement(c, cluster.gpus_per_node)
    time, hidden = step_time(
        model, cluster, c, b, links, states["psi"], recompute=mode, sequence_parallel=sp,
        act_bytes=act_bytes, param_bytes=param_bytes, grad_bytes=grad_bytes, overlap=overlap,
        tp_overlap=tp_overlap, dp_bucket_bytes=dp_bucket_bytes,
        layer_bytes=layer_activation_bytes(model, b, c.tp, sp, act_bytes, mask_bytes, attention),
        overlap_cost=overlap_cost if overlap else 0.0, pp_scatter_gather=pp_scatter_gather,
    )  # fmt: skip
    elementwise = hidden.pop("elementwise")
    per_stage = layers_per_stage(model, c)
    calls = (6 if mode == "full" else 4) * per_stage * c.micro_batches
    dp_ops = _dp_ops(states["psi"], c, param_bytes, grad_bytes)
    detail = {
        "b": b,
        "params_per_gpu": states["psi"],
        "layers_per_stage": per_stage,
        "recompute": mode,
        "attention": attention,
        "sequence_parallel": sp,
        "states_by_stage": states["by_stage"],
        "activations_first": acts["first"],
        "activations_last": acts["last"],
        "logits": acts["logits"],
        "hidden": hidden,
        "elementwise": elementwise,
        "overlap": overlap,
        "efficiency": cluster.matmul_efficiency(b * model.seq_len),
        "tp_bytes": megatron_bytes_per_layer(b, model.seq_len, model.hidden, c.tp, act_bytes)
        * calls
        / 4,
        "dp_bytes": sum(n * ring_bytes(op, x, c.dp) for ph in dp_ops.values() for op, n, x in ph),
    }
    memory = {"model_states": state, "activations": act, "total": total, "limit": limit}
    return Prediction(c, memory, time, links, not reasons, reasons, detail)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_choices(
    model: Transformer,
    n_gpus: int,
    *,
    zero_stages=(0, 1, 2, 3),
    micro_batches=None,
    interleave=(1,),
) -> list[Choice]:
    """Every valid layout on exactly ``n_gpus``: ``tp`` divides heads, hidden and the MLP (and the
    vocabulary when it is not padded); ``pp·v ≤ L`` (uneven splits allowed, the fullest stage
    charged); ``dp · m`` divides ``B``.

    ``micro_batches``: the ``m`` to try (default: every ``m`` that divides ``B/dp``).
    ``interleave``: the ``v`` to try (interleaved 1F1B needs ``m`` a multiple of ``p``). ZeRO
    stages above 0 are skipped when ``dp = 1``: there is nothing to shard over."""
    out = []
    for tp in _divisors(n_gpus):
        for pp in _divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if model.global_batch % dp:
                continue
            for m in micro_batches or _divisors(model.global_batch // dp):
                for v in interleave if pp > 1 else (1,):
                    for z in zero_stages if dp > 1 else (0,):
                        choice = Choice(dp, pp, tp, z, m, v)
                        if not problems(model, choice, n_gpus):
                            out.append(choice)
    return out


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


def _simplest_first(ranked: list[Prediction], tolerance: float) -> list[Prediction]:
    good = [p for p in ranked if p.fits and not (p.choice.tp > 1 and p.links["tp"] == "inter")]
    if not good or tolerance <= 0:
        return ranked
    fastest = good[0].time["total"]
    near = [p for p in good if p.time["total"] <= (1 + tolerance) * fastest]
    c = min(near, key=lambda p: (p.choice.pp, p.choice.interleave, p.choice.tp, p.choice.zero,
                                 p.time["total"]))  # fmt: skip
    return [c] + [p for p in ranked if p is not c]


def plan(
    model: Transformer, cluster: Cluster, n_gpus: int, *, tolerance: float = 0.03, **kw
) -> list[Prediction]:
    """Every valid layout on ``n_gpus``, predicted and ranked (see the module's doc).

    ``zero_stages``, ``micro_batches`` and ``interleave`` (default ``(1, 2, 4)`` chunks per stage)
    go to :func:`valid_choices`, the rest to :func:`predict`. Without ``recompute`` the planner
    tries none, selective and full for every layout and keeps the fastest that fits
    (recomputation costs time, so it is chosen only where memory needs it). ``tolerance``: how
    close to the fastest a simpler layout may be and still come first (0: the fastest, always)."""
    kw.setdefault("interleave", (1, 2, 4))
    choose = {
        key: kw.pop(key) for key in ("zero_stages", "micro_batches", "interleave") if key in kw
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
        preds = [predict(model, cluster, c, n_gpus=n_gpus, recompute=r, **kw) for r in modes]
        out.append(best_of(preds))
    return _simplest_first(sorted(out, key=_rank), tolerance)


__all__ = ["Prediction", "best_of", "placement", "plan", "predict", "problems", "valid_choices"]
