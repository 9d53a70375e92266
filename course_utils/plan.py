"""The 3D-parallelism planner: memory and step time of every (dp, pp, tp, ZeRO) layout, ranked.

    from course_utils.plan import A100_80GB, Transformer, explain, plan, table
    gpt = Transformer(layers=48, hidden=8192, heads=64, seq_len=2048, vocab=51200,
                      global_batch=1536)
    preds = plan(gpt, A100_80GB, 512)
    print(table(preds, limit=5)); print(explain(preds[0], gpt, A100_80GB))

Taught in notebook 07; ``python -m course_utils bench 3d`` checks it against measurement. Pure
arithmetic. The formulas earlier notebooks taught are imported, not re-derived: ZeRO's model
states (08), Korthikanti's activations and Megatron's TP bytes (06), the bubble (05), the α–β ring
costs (03). New here: the FLOP count, the parameters of one shard, and the placement on links.
Megatron's letters: ``L`` layers, ``h`` hidden, ``a`` heads, ``s`` sequence, ``V`` vocabulary,
``B`` global batch, ``b`` micro-batch, ``m`` micro-batches per replica, ``t``/``p``/``d`` degrees.

**Memory per GPU**, on the worst pipeline stage (the first: it holds the most activations, and
the embedding plus position table outweighs the final LayerNorm; both ends are computed and the
larger taken):

- model states: :func:`~course_utils.zero.model_state_bytes` (Rajbhandari et al. 2020, §5) of
  the parameters on one (pp, tp) shard, sharded over ``dp``. The shard (:func:`shard_params`) is
  ``⌈L/p⌉`` layers split Megatron's way (QKV and MLP-up by columns, projections by rows, biases
  of row-parallel layers and LayerNorms replicated), plus the vocabulary-parallel embedding
  ``V·h/t`` and the position table on the first stage, the head ``V·h/t`` on the last.
- activations: 1F1B keeps at most ``p`` micro-batches in flight on the first stage (Narayanan et
  al. 2021, §2.2.1), so ``⌈L/p⌉ · min(p, m)`` layers' worth of
  :func:`~course_utils.tensor_parallel.measure.activation_bytes_per_layer` (Korthikanti et al.
  2022, §4.2.3: ``L`` layers' worth once ``m ≥ p``). With full recomputation only each layer's
  input is kept, ``s·b·h`` values (``/t`` with sequence parallelism; Korthikanti's ``2sbhL``),
  plus one layer's full activations while it is recomputed. The embedding's dropout mask and the
  logits are left out (Korthikanti §4.3: small beside the first stage's layers).
- it fits when the total is at most ``memory_headroom`` of the GPU (the rest: allocator caches,
  NCCL buffers, fragmentation).

**Time per step**, the sum of the terms below (nothing overlapped, so communication is an upper
bound; real runs hide DP's all-reduce behind backward and some of PP's sends):

- compute: Narayanan et al. 2021, §5.1, eq. 3: ``96·B·s·L·h²·(1 + s/6h + V/16Lh)`` FLOPs with full
  recomputation, ``72·B·s·L·h²·(1 + s/6h + V/12Lh)`` without (three passes instead of four; the
  logit layer is never recomputed, hence 16 against 12), at ``peak_flops · efficiency`` on each
  of ``n`` GPUs, times ``⌈L/p⌉·p/L`` when ``p`` does not divide ``L`` (the fullest stage sets the
  pace). Written for any ``ffn_mult`` f: a layer's forward is ``(8+4f)·B·s·h² + 4·B·s²·h``.
- bubble: 1F1B idles ``(p-1)/(m+p-1)`` of the step (``pipeline.simulate.theory_bubble``), i.e.
  ``compute · (p-1)/m`` (Narayanan §2.2.1).
- tp_comm: Megatron's ``f`` and ``g``, four all-reduces of ``b·s·h`` values per layer per
  micro-batch (Narayanan §3.2; ``tensor_parallel.measure.megatron_bytes_per_layer``), six with
  recomputation (the replayed forward repeats its two):
  ``4·⌈L/p⌉·m · all_reduce(b·s·h·act_bytes, t)`` on the TP link. Sequence parallelism swaps each
  all-reduce for an all-gather and a reduce-scatter, the same ring cost.
- pp_comm: each micro-batch crosses a stage boundary forward (activations) and backward
  (their gradient), ``b·s·h`` values (``/t`` with sequence parallelism). On the critical path the
  first forward crosses ``p-1`` boundaries to reach the last stage, which then receives the
  other ``m-1``; backward mirrors it: ``2·(m+p-2)`` point-to-point messages on the PP link.
- dp_comm: the gradients of one (pp, tp) shard over ``dp`` (ZeRO paper, §7): plain DP one
  all-reduce; ZeRO-1 a reduce-scatter of gradients and an all-gather of parameters (the same
  volume). Stages 2 and 3 keep only a gradient shard, so with ``m > 1`` micro-batches they
  reduce-scatter after every micro-batch, and ZeRO-3 also all-gathers the parameters for every
  forward and backward: ``m·RS + AG`` and ``m·(RS + 2·AG)``, i.e. 1.5× plain DP at ``m = 1`` as in
  the paper. (DeepSpeed's pipeline engine refuses ZeRO-2 and 3 outright.)

**Placement**: rank ``= pp_idx·(dp·tp) + dp_idx·tp + tp_idx`` (TP innermost, then DP, PP
outermost: Megatron-Core's order). A dimension's groups use the ``intra`` link when each lies on
one node, else ``inter``: a ring with one inter-node hop runs at the slower link's speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .comm_model import AlphaBeta, fit
from .pipeline.simulate import theory_bubble
from .tensor_parallel.measure import (
    activation_bytes_per_layer,
    megatron_bytes_per_layer,
    ring_bytes,
)
from .zero import STAGES, model_state_bytes

GB = 1e9


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{owner}: {name} must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True)
class Transformer:
    """A GPT as the planner sees it (course_utils.models.GPT's layout, Megatron's letters)."""

    layers: int
    """``L``: transformer layers."""
    hidden: int
    """``h``: hidden size."""
    heads: int
    """``a``: attention heads; ``hidden`` must be a multiple."""
    seq_len: int
    """``s``: tokens per sequence."""
    vocab: int
    """``V``: vocabulary size."""
    global_batch: int
    """``B``: sequences per optimizer step, over all data-parallel replicas."""
    ffn_mult: int = 4
    """MLP width as a multiple of ``h`` (4 in Megatron's formulas)."""
    name: str = ""

    def __post_init__(self):
        names = ("layers", "hidden", "heads", "seq_len", "vocab", "global_batch", "ffn_mult")
        _positive("Transformer", **{n: getattr(self, n) for n in names})
        if self.hidden % self.heads:
            raise ValueError(
                f"Transformer: hidden={self.hidden} must be a multiple of heads={self.heads}"
            )

    def layer_params(self) -> int:
        """One layer: 2 LayerNorms ``4h``, qkv ``3h²+3h``, proj ``h²+h``, MLP ``2fh² + fh + h``."""
        h, f = self.hidden, self.ffn_mult
        return (4 + 2 * f) * h * h + (9 + f) * h

    @property
    def params(self) -> int:
        """All parameters: layers, token and position embeddings, final LayerNorm, untied head.

        Narayanan et al.'s eq. 2 counts the head once (tied); this GPT has ``V·h`` more."""
        h = self.hidden
        return self.layers * self.layer_params() + (2 * self.vocab + self.seq_len + 2) * h

    @classmethod
    def from_gpt_config(cls, cfg, global_batch: int) -> Transformer:
        """The planner's view of :class:`course_utils.models.GPTConfig`."""
        return cls(
            layers=cfg.n_layers,
            hidden=cfg.d_model,
            heads=cfg.n_heads,
            seq_len=cfg.seq_len,
            vocab=cfg.vocab,
            global_batch=global_batch,
            ffn_mult=cfg.ffn_mult,
        )


@dataclass(frozen=True)
class Cluster:
    """GPUs and the two links between them, as the α–β model of notebook 03 describes them."""

    gpus_per_node: int
    memory_bytes: float
    """One GPU's memory."""
    peak_flops: float
    """One GPU's dense 16-bit peak, FLOP/s."""
    intra: AlphaBeta
    """Between GPUs of one node (NVLink), per GPU."""
    inter: AlphaBeta
    """Between nodes (InfiniBand), per GPU: its own NIC's share."""
    efficiency: float = 0.5
    """Fraction of ``peak_flops`` the matmuls reach (Narayanan et al. 2021: 44-52% end to end)."""
    name: str = ""

    def __post_init__(self):
        _positive("Cluster", gpus_per_node=self.gpus_per_node)
        if self.memory_bytes <= 0 or self.peak_flops <= 0 or not 0 < self.efficiency <= 1:
            raise ValueError(
                f"Cluster: need memory_bytes > 0, peak_flops > 0 and 0 < efficiency <= 1, got "
                f"{self.memory_bytes}, {self.peak_flops}, {self.efficiency}"
            )


# Selene's DGX A100 nodes (Narayanan et al. 2021, §5): 8 A100-80GB, 312 TFLOP/s bf16 dense (A100
# datasheet); NVLink 3 at 600 GB/s per GPU both ways, 300 GB/s each way; 8 × 200 Gb/s HDR
# InfiniBand HCAs per node, one per GPU: 25 GB/s. α (our choice, not measured): 5 µs per ring
# step inside a node, as comm_model's example, and twice that across the network.
A100_80GB = Cluster(
    gpus_per_node=8,
    memory_bytes=80e9,
    peak_flops=312e12,
    intra=AlphaBeta(alpha=5e-6, beta=300e9),
    inter=AlphaBeta(alpha=10e-6, beta=25e9),
    efficiency=0.5,
    name="DGX A100 80GB, HDR InfiniBand (Selene)",
)


@dataclass(frozen=True)
class Choice:
    """One layout: ``dp × pp × tp`` GPUs, a ZeRO stage over ``dp``, ``m`` micro-batches."""

    dp: int
    pp: int
    tp: int
    zero: int = 0
    micro_batches: int = 1
    """``m``: micro-batches per replica and step (pipeline or gradient accumulation)."""

    def __post_init__(self):
        _positive("Choice", dp=self.dp, pp=self.pp, tp=self.tp, micro_batches=self.micro_batches)
        if self.zero not in STAGES:
            raise ValueError(f"Choice: zero must be 0, 1, 2 or 3, not {self.zero!r}")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.pp * self.tp

    def micro_batch_size(self, model: Transformer) -> int:
        """``b = B / (dp · m)``; it must be whole."""
        b, rest = divmod(model.global_batch, self.dp * self.micro_batches)
        if rest or b == 0:
            raise ValueError(
                f"global batch {model.global_batch} is not divisible by dp={self.dp} × "
                f"m={self.micro_batches} = {self.dp * self.micro_batches}: pick m dividing "
                f"{model.global_batch}/dp"
            )
        return b


@dataclass
class Prediction:
    """What :func:`predict` says about one :class:`Choice`."""

    choice: Choice
    memory: dict
    """Bytes per GPU: ``model_states``, ``activations``, ``total``, and the usable ``limit``."""
    time: dict
    """Seconds per step: ``compute``, ``bubble``, ``tp_comm``, ``pp_comm``, ``dp_comm``,
    ``total``."""
    links: dict
    """``{"tp": "intra" | "inter", "pp": ..., "dp": ...}`` as placed."""
    fits: bool
    reasons: list[str]
    """Why it does not fit or is invalid, with the numbers; empty when it fits."""
    detail: dict = field(default_factory=dict)
    """``b``, ``params_per_gpu``, ``layers_per_stage``, ``recompute``, ``states_by_stage``, ..."""


def problems(model: Transformer, choice: Choice, n_gpus: int | None = None) -> list[str]:
    """Why ``choice`` is not a valid layout of ``model`` (on ``n_gpus``), in words with numbers."""
    c, out = choice, []
    if n_gpus is not None and c.n_gpus != n_gpus:
        out.append(f"dp={c.dp} × pp={c.pp} × tp={c.tp} = {c.n_gpus}, but n_gpus is {n_gpus}")
    sizes = {
        "heads": model.heads,
        "hidden": model.hidden,
        "ffn": model.ffn_mult * model.hidden,
        "vocab": model.vocab,
    }
    for name, size in sizes.items():
        if size % c.tp:
            out.append(f"{name}={size} is not divisible by tp={c.tp}")
    if model.layers < c.pp:
        out.append(f"layers={model.layers} < pp={c.pp}: a stage would have no layer")
    if model.global_batch % (c.dp * c.micro_batches):
        out.append(
            f"global batch {model.global_batch} is not divisible by dp={c.dp} × "
            f"m={c.micro_batches} = {c.dp * c.micro_batches}"
        )
    return out


def shard_params(model: Transformer, pp: int, tp: int) -> float:
    """Parameters one GPU holds on the heavier end stage of a ``pp × tp`` split (Megatron's)."""
    h, f, V, s = model.hidden, model.ffn_mult, model.vocab, model.seq_len
    per_layer = ((4 + 2 * f) * h * h + (3 + f) * h) / tp + 6 * h  # 6h: LayerNorms, row biases
    if pp == 1:
        return model.layers * per_layer + 2 * V * h / tp + s * h + 2 * h
    layers = math.ceil(model.layers / pp)
    first = layers * per_layer + V * h / tp + s * h  # embedding (vocab-parallel), positions
    last = layers * per_layer + 2 * h + V * h / tp  # final LayerNorm, head (column-parallel)
    return max(first, last)


def flops_per_step(model: Transformer, recompute: bool = False) -> float:
    """FLOPs of one step: Narayanan et al. 2021, eq. 3 (``recompute=True``) or its three-pass
    form, written for any ``ffn_mult``."""
    B, s, L, h, V = model.global_batch, model.seq_len, model.layers, model.hidden, model.vocab
    forward_layer = (8 + 4 * model.ffn_mult) * B * s * h * h + 4 * B * s * s * h
    return (4 if recompute else 3) * L * forward_layer + 6 * B * s * h * V


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


def _dp_traffic(psi: float, choice: Choice, param_bytes: float, grad_bytes: float) -> list:
    """``(collective, calls per step, bytes)`` of one step's data-parallel traffic (ZeRO §7)."""
    m, g, p = choice.micro_batches, psi * grad_bytes, psi * param_bytes
    return {
        0: [("all_reduce", 1, g)],
        1: [("reduce_scatter", 1, g), ("all_gather", 1, p)],
        2: [("reduce_scatter", m, g), ("all_gather", 1, p)],
        3: [("reduce_scatter", m, g), ("all_gather", 2 * m, p)],
    }[choice.zero]


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
    sequence_parallel: bool = False,
    recompute: bool = False,
    memory_headroom: float = 0.9,
    n_gpus: int | None = None,
) -> Prediction:
    """Memory per GPU and seconds per step of ``choice`` (the module docstring gives the model).

    An invalid choice still gets numbers (with a fractional ``b`` if need be), ``fits=False`` and
    the reasons; ``n_gpus`` adds the check that the layout uses exactly that many GPUs."""
    c, (L, h, a, s) = choice, (model.layers, model.hidden, model.heads, model.seq_len)
    reasons = problems(model, c, n_gpus)
    b = model.global_batch / (c.dp * c.micro_batches)
    b = int(b) if b == int(b) else b
    m, t, p = c.micro_batches, c.tp, c.pp
    per_stage = math.ceil(L / p)
    split = t if sequence_parallel else 1

    psi = shard_params(model, p, t)
    by_stage = [model_state_bytes(psi, c.dp, z, k, param_bytes, grad_bytes) for z in STAGES]
    layer = activation_bytes_per_layer(s, b, h, a, t, sequence_parallel, act_bytes, mask_bytes)
    in_flight = per_stage * min(p, m)  # layers' worth of micro-batches on the first stage
    if recompute:
        acts = in_flight * act_bytes * s * b * h / split + layer
    else:
        acts = in_flight * layer
    total = by_stage[c.zero] + acts
    limit = memory_headroom * cluster.memory_bytes
    if total > limit:
        reasons.append(
            f"needs {total / GB:.1f} GB per GPU (model states {by_stage[c.zero] / GB:.1f} + "
            f"activations {acts / GB:.1f}) but {memory_headroom:.0%} of "
            f"{cluster.memory_bytes / GB:.0f} GB is {limit / GB:.1f} GB"
        )

    links = placement(c, cluster.gpus_per_node)
    link = {d: cluster.intra if links[d] == "intra" else cluster.inter for d in links}
    rate = c.n_gpus * cluster.peak_flops * cluster.efficiency
    compute = flops_per_step(model, recompute) / rate * (per_stage * p / L)  # fullest stage
    frac = theory_bubble(p, m)  # (p-1)/(m+p-1) of the step, so (p-1)/m of the compute
    tp_calls = (6 if recompute else 4) * per_stage * m
    pp_messages = 2 * (m + p - 2) if p > 1 else 0
    dp_ops = _dp_traffic(psi, c, param_bytes, grad_bytes)
    time = {
        "compute": compute,
        "bubble": compute * frac / (1 - frac),
        "tp_comm": tp_calls * link["tp"].all_reduce(b * s * h * act_bytes, t),
        "pp_comm": pp_messages * link["pp"].p2p(b * s * h * act_bytes / split),
        "dp_comm": sum(n * getattr(link["dp"], op)(x, c.dp) for op, n, x in dp_ops),
    }
    time["total"] = sum(time.values())
    detail = {
        "b": b,
        "params_per_gpu": psi,
        "layers_per_stage": per_stage,
        "recompute": recompute,
        "sequence_parallel": sequence_parallel,
        "states_by_stage": by_stage,
        "tp_bytes": megatron_bytes_per_layer(b, s, h, t, act_bytes) * tp_calls / 4,
        "dp_bytes": sum(n * ring_bytes(op, x, c.dp) for op, n, x in dp_ops),
    }
    memory = {"model_states": by_stage[c.zero], "activations": acts, "total": total, "limit": limit}
    return Prediction(c, memory, time, links, not reasons, reasons, detail)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_choices(
    model: Transformer, n_gpus: int, *, zero_stages=(0, 1, 2, 3), micro_batches=None
) -> list[Choice]:
    """Every valid layout on exactly ``n_gpus``: ``tp`` divides heads, hidden, ffn and vocab;
    ``pp ≤ L`` (uneven splits allowed, the fullest stage charged); ``dp · m`` divides ``B``.

    ``micro_batches``: the ``m`` to try (default: every ``m`` that divides ``B/dp``). ZeRO stages
    above 0 are skipped when ``dp = 1``: there is nothing to shard over."""
    out = []
    for tp in _divisors(n_gpus):
        for pp in _divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if model.global_batch % dp:
                continue
            for m in micro_batches or _divisors(model.global_batch // dp):
                for z in zero_stages if dp > 1 else (0,):
                    choice = Choice(dp, pp, tp, z, m)
                    if not problems(model, choice, n_gpus):
                        out.append(choice)
    return out


def _rank(pred: Prediction) -> tuple:
    # equal times (ZeRO-1's RS + AG is plain DP's all-reduce) go to the simpler, smaller layout
    return (
        not pred.fits,
        float(f"{pred.time['total']:.9g}"),
        pred.choice.zero,
        pred.memory["total"],
    )


def plan(model: Transformer, cluster: Cluster, n_gpus: int, **kw) -> list[Prediction]:
    """Every valid layout on ``n_gpus``, predicted and ranked: those that fit first, fastest first.

    ``zero_stages`` and ``micro_batches`` go to :func:`valid_choices`, the rest to
    :func:`predict`."""
    choose = {key: kw.pop(key) for key in ("zero_stages", "micro_batches") if key in kw}
    choices = valid_choices(model, n_gpus, **choose)
    if not choices:
        raise ValueError(
            f"no layout of {n_gpus} GPUs is valid for {model.name or model}: tp must divide "
            f"heads={model.heads}, pp must be at most layers={model.layers}, and dp must divide "
            f"the global batch {model.global_batch}; try another GPU count"
        )
    return sorted((predict(model, cluster, c, n_gpus=n_gpus, **kw) for c in choices), key=_rank)


def _s(x: float) -> str:
    return f"{x:.3g} s"


def explain(pred: Prediction, model: Transformer, cluster: Cluster) -> str:
    """The choice in the lectures' terms: which dimension sits on which link and why, and ZeRO."""
    c, T, d, g = pred.choice, pred.time, pred.detail, cluster.gpus_per_node
    nodes = math.ceil(c.n_gpus / g)
    lines = [
        f"dp={c.dp} × pp={c.pp} × tp={c.tp} on {c.n_gpus} GPUs ({nodes} node(s) of {g}), "
        f"m={c.micro_batches} micro-batches of b={d['b']}, ZeRO-{c.zero}: "
        f"{_s(T['total'])} per step predicted."
    ]
    tp_bytes = d["tp_bytes"] / GB
    if c.tp == 1:
        lines.append("TP=1: every GPU computes whole layers; no all-reduce inside a layer.")
    elif pred.links["tp"] == "intra":
        lines.append(
            f"TP={c.tp} stays inside a node on NVLink: its all-reduces after every attention and "
            f"MLP block move {tp_bytes:.3g} GB per GPU per step: {_s(T['tp_comm'])} on the fast "
            "link."
        )
    else:
        why = (
            f"tp={c.tp} > {g} GPUs per node" if c.tp > g else f"{g} is not a multiple of tp={c.tp}"
        )
        lines.append(
            f"TP={c.tp} crosses nodes ({why}): {tp_bytes:.3g} GB per GPU per step of all-reduces "
            f"on the inter-node link cost {_s(T['tp_comm'])}; keep TP within {g} GPUs if you can."
        )
    if c.pp == 1:
        lines.append("PP=1: no pipeline, so no bubble; every GPU holds all layers.")
    else:
        where = "across nodes" if pred.links["pp"] == "inter" else "inside a node"
        frac = theory_bubble(c.pp, c.micro_batches)
        lines.append(
            f"PP={c.pp} {where}: a stage boundary only passes b·s·h activations point to point "
            f"({_s(T['pp_comm'])}), which a slow link tolerates; each stage holds "
            f"{d['layers_per_stage']} layer(s). The 1F1B bubble (p-1)/(m+p-1) = {frac:.1%} of the "
            f"step costs {_s(T['bubble'])}."
        )
    if c.dp == 1:
        lines.append("DP=1: one replica; no gradient all-reduce.")
    else:
        link = "inside a node" if pred.links["dp"] == "intra" else "across nodes"
        lines.append(
            f"DP={c.dp} over the rest, {link}: each GPU sends {d['dp_bytes'] / GB:.3g} GB per "
            f"step ({'gradients, parameters' if c.zero else 'gradients'}), {_s(T['dp_comm'])} if "
            "not overlapped with backward."
        )
    states = d["states_by_stage"]
    lowest = next(
        (z for z in STAGES if states[z] + pred.memory["activations"] <= pred.memory["limit"]), None
    )
    if lowest is None:
        lines.append(
            f"ZeRO-{c.zero}: even ZeRO-3's {states[3] / GB:.1f} GB of states leave no room for "
            f"the activations: more GPUs for pp or tp, recomputation, or a smaller micro-batch."
        )
    elif c.zero == 0:
        lines.append(f"ZeRO off: the replicated model states ({states[0] / GB:.1f} GB) fit.")
    elif lowest == c.zero:
        lower = ", ".join(f"ZeRO-{z} {states[z] / GB:.1f} GB" for z in range(lowest))
        acts, limit = pred.memory["activations"] / GB, pred.memory["limit"] / GB
        lines.append(
            f"ZeRO-{c.zero} ({STAGES[c.zero]}) because with less sharding the states would not "
            f"fit beside {acts:.1f} GB of activations in {limit:.1f} GB ({lower}); sharded over "
            f"dp={c.dp} they take {states[c.zero] / GB:.1f} GB."
        )
    else:
        lines.append(
            f"ZeRO-{c.zero}, although ZeRO-{lowest} would already fit ({states[lowest] / GB:.1f} "
            f"GB of states): the higher stage saves memory, not time."
        )
    mem = pred.memory
    lines.append(
        f"Memory per GPU: states {mem['model_states'] / GB:.1f} GB + activations "
        f"{mem['activations'] / GB:.1f} GB{' (recomputed)' if d['recompute'] else ''} = "
        f"{mem['total'] / GB:.1f} GB of {mem['limit'] / GB:.1f} GB usable."
    )
    lines.append(
        "Step: "
        + ", ".join(
            f"{key} {_s(T[key])}" for key in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm")
        )
        + " (communication not overlapped: an upper bound)."
    )
    if pred.reasons:
        lines.append("Does not fit or is invalid: " + "; ".join(pred.reasons) + ".")
    return "\n".join(lines)


def table(preds: list[Prediction], limit: int | None = None) -> str:
    """A markdown table of predictions, one row each."""
    keys = ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm")
    head = ["dp", "pp", "tp", "zero", "m", "b", "memory GB", "step s", *keys, "fits"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + ":---:|"]
    for p in preds[:limit]:
        c = p.choice
        cells = [c.dp, c.pp, c.tp, c.zero, c.micro_batches, p.detail["b"]]
        cells += [f"{p.memory['total'] / GB:.1f}", f"{p.time['total']:.3g}"]
        cells += [f"{p.time[key]:.3g}" for key in keys] + ["yes" if p.fits else "no"]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(lines)


# Narayanan et al. 2021 (arXiv:2104.04473), Table 1: weak scaling on Selene, sequence 2048,
# vocabulary 51,200, mixed precision; params in billions, achieved teraFLOP/s per GPU. Numbers
# from the paper, checked against a structured transcription of its Table 1 found with the
# course's search tool.
NARAYANAN_SEQ_LEN, NARAYANAN_VOCAB = 2048, 51200
NARAYANAN_TABLE1: list[dict] = [
    dict(params_b=p, heads=a, hidden=h, layers=L, t=t, p=pp, gpus=n, batch=B, tflops_per_gpu=x)
    for p, a, h, L, t, pp, n, B, x in [
        (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
        (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
        (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    ]
]


def narayanan_model(row: dict) -> Transformer:
    """The :class:`Transformer` of one :data:`NARAYANAN_TABLE1` row."""
    return Transformer(
        layers=row["layers"],
        hidden=row["hidden"],
        heads=row["heads"],
        seq_len=NARAYANAN_SEQ_LEN,
        vocab=NARAYANAN_VOCAB,
        global_batch=row["batch"],
        name=f"GPT-{row['params_b']}B",
    )


def _best(preds) -> Prediction:
    return min(preds, key=_rank)


def _why(ours: Prediction, theirs: Prediction) -> str:
    """Why the planner's layout differs from the paper's (both predicted with or both without
    recomputation, as ours)."""
    o, p = ours.choice, theirs.choice
    rc = "with" if ours.detail["recompute"] else "without"
    if (o.tp, o.pp) == (p.tp, p.pp):
        out = ["same (t, p)"]
    elif not theirs.fits:
        why = theirs.reasons[-1]
        out = [f"the paper's (t, p) with ZeRO off does not fit {rc} recomputation here: {why}"]
    else:
        keys = ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm")
        diff = {key: theirs.time[key] - ours.time[key] for key in keys}
        gain, loss = max(diff, key=diff.get), min(diff, key=diff.get)
        slower = theirs.time["total"] / ours.time["total"] - 1
        saves = f"ours saves {diff[gain]:.2g} s of {gain}"
        out = [f"the paper's (t, p) is {slower:.0%} slower here: {saves}"]
        if diff[loss] < 0:
            out.append(f"pays {-diff[loss]:.2g} s more {loss}")
    if o.zero:
        states = ours.detail["states_by_stage"]
        out.append(
            f"ZeRO-{o.zero} over dp={o.dp} cuts the states from {states[0] / GB:.0f} to "
            f"{states[o.zero] / GB:.0f} GB (the paper keeps ZeRO off)"
        )
    if not ours.detail["recompute"]:
        out.append("the activations fit, so ours skips recomputation (a quarter of the FLOPs)")
    return "; ".join(out)


def compare_narayanan(cluster: Cluster = A100_80GB, **kw) -> list[dict]:
    """For each row of Table 1: the paper's ``(t, p)``, the planner's best layout at the paper's GPU
    count and batch, our predictions for both, the paper's measured step time, and why they differ.

    Without ``recompute`` in ``kw`` the planner tries both and keeps the fastest layout that fits;
    the paper's layout (ZeRO off, its best ``m``) is predicted with recomputation, as the paper ran
    (its FLOP count, eq. 3, includes the recomputed forward). ``kw`` goes to :func:`plan`.
    """
    settings = [kw["recompute"]] if "recompute" in kw else [False, True]
    pk = {
        key: v for key, v in kw.items() if key not in ("zero_stages", "micro_batches", "recompute")
    }
    out = []
    for row in NARAYANAN_TABLE1:
        model, n = narayanan_model(row), row["gpus"]
        ours = _best(plan(model, cluster, n, **{**kw, "recompute": rc})[0] for rc in settings)
        dp = n // (row["t"] * row["p"])
        theirs = {
            rc: _best(
                predict(
                    model,
                    cluster,
                    Choice(dp, row["p"], row["t"], 0, m),
                    n_gpus=n,
                    recompute=rc,
                    **pk,
                )
                for m in _divisors(row["batch"] // dp)
            )
            for rc in {*settings, kw.get("recompute", True)}
        }
        c = ours.choice
        measured = flops_per_step(model, recompute=True) / (n * row["tflops_per_gpu"] * 1e12)
        out.append(
            {
                "model": model.name,
                "gpus": n,
                "batch": row["batch"],
                "paper_t": row["t"],
                "paper_p": row["p"],
                "t": c.tp,
                "p": c.pp,
                "dp": c.dp,
                "m": c.micro_batches,
                "zero": c.zero,
                "recompute": ours.detail["recompute"],
                "fits": ours.fits,
                "memory_gb": ours.memory["total"] / GB,
                "step_s": ours.time["total"],
                "paper_layout_step_s": theirs[kw.get("recompute", True)].time["total"],
                "paper_measured_step_s": measured,
                "why": _why(ours, theirs[ours.detail["recompute"]]),
            }
        )
    return out


def fit_link(report: dict, op: str = "all_reduce") -> AlphaBeta:
    """``α`` and ``β`` of the link a ``bench collectives --json`` report ran on.

    A ring on ``n`` ranks takes ``k(n-1)·α + k(n-1)/n · size/β`` (``k = 2`` for all-reduce, 1 for
    all-gather and reduce-scatter), so ``time / (k(n-1)) = α + (size/n)/β``: a straight line in
    ``size/n``, fitted by least squares with :func:`course_utils.comm_model.fit`."""
    steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if op not in steps:
        raise ValueError(f"fit_link inverts the ring formulas of {sorted(steps)}, not {op!r}")
    n = report["world_size"]
    if n == 1:
        raise ValueError(
            "the report comes from 1 rank, which sends nothing: run "
            "`python -m course_utils bench collectives --world-size 2 --json` or more ranks"
        )
    rows = [r for r in report["rows"] if r["op"] == op]
    if len({r["bytes"] for r in rows}) < 2:
        have = sorted({r["op"] for r in report["rows"]})
        raise ValueError(
            f"the report has {len(rows)} {op} row(s) (it has {have or 'none'}); a line needs at "
            "least two message sizes: rerun bench collectives with a larger --max-bytes"
        )
    k = steps[op] * (n - 1)
    return fit([r["bytes"] / n for r in rows], [r["time_us"] * 1e-6 / k for r in rows])


__all__ = [
    "A100_80GB",
    "NARAYANAN_TABLE1",
    "Choice",
    "Cluster",
    "Prediction",
    "Transformer",
    "compare_narayanan",
    "explain",
    "fit_link",
    "flops_per_step",
    "narayanan_model",
    "placement",
    "plan",
    "predict",
    "problems",
    "shard_params",
    "table",
    "valid_choices",
]
