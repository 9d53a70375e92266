"""Which parallelism to use: the lectures' decision summary, with the planner's memory and time.

The CSC lecture's rules, in the order they are asked:

1. the model fits in data parallelism (its states replicated, or sharded by ZeRO over the
   data-parallel GPUs, beside the activations of a micro-batch) → **DDP or ZeRO / FSDP**: the
   fastest of the stages that fit (each with its framework's bytes per parameter and traffic:
   ZeRO-2 and FSDP reduce after every micro-batch, FSDP gathers every layer for each);
2. it does not, because a layer (gathered by ZeRO-3) or a micro-batch's activations are too large
   → **tensor parallelism** inside a node (notebook 06), where NVLink carries its all-reduces;
3. the GPUs of a node have **no fast link between them** (PCIe only: no NVLink or its peers) →
   **pipeline parallelism** instead of TP (notebook 05): it sends only activations at stage
   boundaries, point to point, which PCIe tolerates; TP's per-layer all-reduces would wait on it.
   A pipeline keeps each layer whole on one GPU, though: when a layer does not fit (or every
   layout without TP is slower) the advice says so and names the planner's TP layout.

Memory and time come from :mod:`course_utils.plan`: ZeRO's states of the shard (08), Korthikanti's
activations (06), compute at a compute-only efficiency, the α–β cost of each collective (03),
hidden behind backward where it can be. For rule 1 every micro-batch size and recomputation
(none, selective, full) is tried, and the fastest that fits is kept.
"""

from __future__ import annotations

from ..plan import RECOMPUTE, Choice, Cluster, Transformer, best_of, plan, predict
from ..zero.memory import STAGES

NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}
FAST_LINK = 100e9  # bytes/s each way: NVLink class; PCIe 4.0 x16 gives about 25


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def decide(model: Transformer, cluster: Cluster, n_gpus: int, **kw) -> dict:
    """The decision for ``model`` on ``n_gpus`` of ``cluster``: per stage of plain data
    parallelism (``tp = pp = 1``), its memory per GPU and step time at its best micro-batch and
    recomputation, whether it fits; the advice in the lectures' words; and the planner's fastest
    layout of all, to compare. ``kw`` goes to :func:`course_utils.plan.predict`."""
    if model.global_batch % n_gpus:
        raise ValueError(
            f"the global batch {model.global_batch} does not split over {n_gpus} data-parallel "
            "GPUs: choose a batch that is a multiple of the GPU count"
        )
    rows = []
    for z in STAGES if n_gpus > 1 else (0,):
        preds = [
            predict(model, cluster, Choice(n_gpus, 1, 1, z, m), recompute=r, **kw)
            for m in _divisors(model.global_batch // n_gpus)
            for r in RECOMPUTE
        ]
        fit = [p for p in preds if p.fits]
        best = best_of(fit) if fit else min(preds, key=lambda p: p.memory["total"])
        rows.append({"stage": z, "name": NAMES[z], "bytes": best.memory["total"],
                     "states": best.memory["model_states"], "activations": best.memory["activations"],
                     "step_s": best.time["total"], "fits": best.fits, "prediction": best})  # fmt: skip
    ranked = plan(model, cluster, n_gpus, **kw)
    overall = ranked[0]
    fitting = [r for r in rows if r["fits"]]
    advice = []
    fast = cluster.intra.beta >= FAST_LINK
    pure_dp = (overall.choice.tp, overall.choice.pp, overall.choice.cp) == (1, 1, 1)
    best_dp = min(fitting, key=lambda r: (r["step_s"], r["stage"])) if fitting else None
    if overall.fits and pure_dp:
        advice.append(
            f"data parallelism: the planner's pick is {_layout(overall)}, "
            f"{overall.time['total']:.3g} s per step"
            + (
                " (within 5% of the fastest: an equal, by the planner's tie rule)"
                if overall.tied
                else ""
            )  # fmt: skip
        )
    elif overall.fits and best_dp:
        advice.append(
            f"model parallelism although {best_dp['name']} fits: the planner's pick is "
            f"{_layout(overall)}, {overall.time['total']:.3g} s per step, against "
            f"{best_dp['step_s']:.3g} s for {best_dp['name']}, the fastest data-parallel stage "
            "that fits"
        )
    elif overall.fits:
        if fast:
            why = ("no data-parallel stage fits, even ZeRO-3 with recomputation (a layer "
                   "gathered whole, or a micro-batch's activations, is too large): model "
                   "parallelism, tensor parallelism inside a node on its fast link")  # fmt: skip
        else:
            slow = ("no data-parallel stage fits, and this node has no fast link between its GPUs "
                    f"(PCIe only, {cluster.intra.beta / 1e9:.0f} GB/s)")  # fmt: skip
            no_tp = min((p for p in ranked if p.fits and p.choice.tp == 1), default=None,
                        key=lambda p: p.time["total"])  # fmt: skip
            if overall.choice.tp == 1:
                why = (f"{slow}: pipeline parallelism, whose point-to-point activations PCIe "
                       "tolerates, rather than TP's per-layer all-reduces")  # fmt: skip
            elif no_tp is None:
                why = (f"{slow}, yet tensor parallelism over it: a pipeline keeps each layer whole "
                       "on one GPU, and no layout without TP fits")  # fmt: skip
            else:
                why = (f"{slow}, yet tensor parallelism over it: the fastest layout without TP, "
                       f"{_layout(no_tp)}, takes {no_tp.time['total']:.3g} s per step")  # fmt: skip
        advice.append(f"{why}; the planner's pick: {_layout(overall)}, "
                      f"{overall.time['total']:.3g} s per step")  # fmt: skip
    else:
        advice.append(
            f"no layout of {n_gpus} GPUs fits: more GPUs, or offload the parameters too "
            "(ZeRO-Infinity; ZeRO-Offload keeps every parameter on each GPU, so it cannot help "
            "when the parameters alone do not fit)"
        )
    if best_dp and overall.fits and pure_dp and best_dp["stage"] != overall.choice.zero:
        advice.append(
            f"the fastest data-parallel stage alone, {best_dp['name']}, takes "
            f"{best_dp['step_s']:.3g} s per step (its best micro-batch and recomputation)"
        )
    return {"rows": rows, "advice": advice, "overall": overall,
            "usable_bytes": rows[0]["prediction"].memory["limit"]}  # fmt: skip


def _layout(pred) -> str:
    c = pred.choice
    extra = "".join(f" {k}={getattr(c, k)}" for k in ("cp", "ep") if getattr(c, k) > 1)
    return f"dp={c.dp} pp={c.pp} tp={c.tp}{extra} {c.family} m={c.micro_batches}"


def table(result: dict) -> str:
    head = f"{'':14} {'GB per GPU':>11} {'states':>7} {'acts':>6} {'step s':>8}  fits in "
    lines = [head + f"{result['usable_bytes'] / 1e9:.0f} GB?"]
    for r in result["rows"]:
        rc = r["prediction"].detail["recompute"]
        lines.append(
            f"{r['name']:14} {r['bytes'] / 1e9:>11.1f} {r['states'] / 1e9:>7.1f} "
            f"{r['activations'] / 1e9:>6.1f} {r['step_s']:>8.3g}  {'yes' if r['fits'] else 'no'}"
            f" (recomputation {rc}, m={r['prediction'].choice.micro_batches})"
        )
    lines += ["→ " + a for a in result["advice"]]
    return "\n".join(lines)


__all__ = ["FAST_LINK", "NAMES", "decide", "table"]
