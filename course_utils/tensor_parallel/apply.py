"""Apply tensor parallelism to an ordinary model from a plan written as a literal table.

The model never imports ``torch.distributed`` (STYLE.md); :func:`apply_tp` swaps its layers for
the parallel ones of :mod:`.layers`, cut from the full weights, so the parallel model computes what
the single-device model computes. torch's ``parallelize_module`` is the model for it::

    plan = {
        "embed": "vocab",
        "blocks.*.attn.qkv": "colwise",   # '*' matches one name: every block
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise",
        "head": "colwise",                # logits stay sharded by vocabulary
    }
    apply_tp(model, plan)                 # every rank, same plan; group=None: all ranks

Styles (``t`` = the group's size, activations ``(B, T, h)``):

==================  ============================================================================
``colwise``         :class:`ColumnParallelLinear`: output features split; ``f`` before it
``colwise_gather``  the same, with the output all-gathered back to full width
``rowwise``         :class:`RowParallelLinear`: input features split; ``g`` after it, then the bias
``vocab``           :class:`VocabParallelEmbedding`: rows split by token id; ``g`` after it
``colwise_sp``      ``colwise`` whose input is split along the sequence (all-gathered in forward)
``rowwise_sp``      ``rowwise`` whose output is reduce-scattered along the sequence
``vocab_sp``        ``vocab`` whose output is reduce-scattered along the sequence
``sequence``        a module (LayerNorm, dropout) run on this rank's part of the sequence; its
                    parameters' gradients are all-reduced over the group
``sequence_input``  the module's input is split along the sequence (forward: keep this rank's
                    slice; backward: all-gather): where a sequence-parallel region begins
``dropout_tp``      a dropout inside the tensor-parallel region (attention probabilities): its
                    mask drawn from this rank's own stream (:class:`.random.ForkedDropout`)
==================  ============================================================================

Taught in notebook 06; reused by notebook 07.
"""

from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn

from .comm import split_to_sp
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    reduce_grad_over_tp,
)
from .random import ForkedDropout, RNGTracker

STYLES = (
    "colwise",
    "colwise_gather",
    "rowwise",
    "vocab",
    "colwise_sp",
    "rowwise_sp",
    "vocab_sp",
    "sequence",
    "sequence_input",
    "dropout_tp",
)


class PlanError(ValueError):
    """A tensor-parallel plan that cannot apply to this model; nothing was changed."""


def _expand(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str]]:
    """``(module name, style)`` for every module the plan names, '*' expanded, in model order."""
    names = [n for n, _ in model.named_modules() if n]
    out, claimed = [], {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"plan[{pattern!r}] = {style!r}: unknown style; choose one of {STYLES}")
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        hits = [n for n in names if regex.match(n)]
        if not hits:
            near = sorted({n for n in names if n.split(".")[-1] == pattern.split(".")[-1]})[:4]
            hint = f"; modules with that last name: {near}" if near else ""
            raise PlanError(
                f"plan names {pattern!r}, but {type(model).__name__} has no such module{hint}"
            )
        for n in hits:
            if n in claimed:
                raise PlanError(
                    f"{n!r} is named twice in the plan ({claimed[n]!r} and {pattern!r})"
                )
            claimed[n] = pattern
            out.append((n, style))
    order = {n: i for i, n in enumerate(names)}
    return sorted(out, key=lambda x: order[x[0]])


def _heads_of(model: nn.Module, name: str) -> int | None:
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return getattr(parent, "n_heads", None)


def _check(model: nn.Module, name: str, style: str, t: int) -> None:
    mod = model.get_submodule(name)
    kind = style.split("_")[0]
    if kind in ("colwise", "rowwise"):
        if type(mod) is not nn.Linear:
            raise PlanError(f"{name} ({type(mod).__name__}): {style!r} needs an nn.Linear")
        what, n = (
            ("out_features", mod.out_features)
            if kind == "colwise"
            else ("in_features", mod.in_features)
        )
        if n % t:
            raise PlanError(
                f"{name}: {what}={n} does not split over t={t} ranks; pick a tensor-parallel "
                f"degree that divides {n}"
            )
        heads = _heads_of(model, name)
        if heads is not None and heads % t:
            raise PlanError(
                f"{name}: its attention has {heads} heads, which do not split over t={t} ranks "
                "(each rank must hold whole heads)"
            )
    elif style == "dropout_tp":
        if type(mod) not in (nn.Dropout, nn.Identity):
            raise PlanError(f"{name} ({type(mod).__name__}): 'dropout_tp' needs an nn.Dropout")
    elif kind == "vocab":
        if type(mod) is not nn.Embedding:
            raise PlanError(f"{name} ({type(mod).__name__}): {style!r} needs an nn.Embedding")
        if mod.num_embeddings % t:
            raise PlanError(
                f"{name}: num_embeddings={mod.num_embeddings} does not split over t={t} ranks; "
                "pad the vocabulary to a multiple of t (Megatron-LM pads it to a multiple of 128·t)"
            )


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _split_input_hook(group):
    def hook(module, args):
        return (split_to_sp(args[0], group), *args[1:])

    return hook


def apply_tp(model: nn.Module, plan: dict[str, str], group=None, seed: int = 0) -> nn.Module:
    """Shard ``model`` in place following ``plan`` over ``group`` (default: every rank); return it.

    Every name and dimension is checked before anything changes: a plan that names a module the
    model lacks, or a dimension the tensor-parallel degree does not divide, raises
    :class:`PlanError` naming the module and the numbers, and leaves the model as it was.
    ``seed`` seeds the tensor-parallel random stream of ``dropout_tp`` modules
    (:class:`.random.RNGTracker`: ``seed + 2718 + rank``).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "apply_tp needs a process group: call it inside a rank started by course_utils.launch "
            "(or after torch.distributed.init_process_group)"
        )
    t = dist.get_world_size(group)
    todo = _expand(model, plan)
    for name, style in todo:
        _check(model, name, style, t)
    tracker = None
    for name, style in todo:
        mod = model.get_submodule(name)
        if style == "dropout_tp":
            device = next(model.parameters()).device
            tracker = tracker or RNGTracker(seed, group, device)
            _swap(model, name, ForkedDropout(getattr(mod, "p", 0.0), tracker))
            continue
        sp = style.endswith("_sp")
        if style in ("colwise", "colwise_gather", "colwise_sp"):
            new = ColumnParallelLinear.from_linear(
                mod, group, gather_output=style == "colwise_gather", sequence_parallel=sp
            )
        elif style in ("rowwise", "rowwise_sp"):
            new = RowParallelLinear.from_linear(mod, group, sequence_parallel=sp)
        elif style in ("vocab", "vocab_sp"):
            new = VocabParallelEmbedding.from_embedding(mod, group, sequence_parallel=sp)
        elif style == "sequence":
            for p in mod.parameters():
                if p.requires_grad:
                    reduce_grad_over_tp(p, group)
            continue
        else:  # sequence_input
            mod.register_forward_pre_hook(_split_input_hook(group))
            continue
        _swap(model, name, new)
    return model


def gpt_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """The plan for :class:`course_utils.models.GPT`: Megatron-LM's, as a literal table.

    Attention: ``qkv`` column-wise (each rank gets whole heads, with their Q, K and V), ``proj``
    row-wise. MLP: ``up`` column-wise, ``down`` row-wise. The embedding by vocabulary, the head
    column-wise with its logits left sharded for :func:`vocab_parallel_cross_entropy`. With
    sequence parallelism, LayerNorms run on sequence shards and the all-reduces become
    all-gathers and reduce-scatters (Korthikanti et al. 2022). Dropouts whose input differs from
    rank to rank (the attention probabilities of each rank's heads; with sequence parallelism also
    those on each rank's positions) draw their masks from the tensor-parallel random stream.
    """
    if not sequence_parallel:
        return {
            "embed": "vocab",
            "blocks.*.attn.qkv": "colwise",
            "blocks.*.attn.attn_drop": "dropout_tp",  # each rank's heads: their own masks
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.up": "colwise",
            "blocks.*.mlp.down": "rowwise",
            "head": "colwise",
        }
    return {
        "embed": "vocab",
        "blocks.0": "sequence_input",  # token + position embeddings are whole; split here
        "blocks.*.ln1": "sequence",
        "blocks.*.attn.qkv": "colwise_sp",
        "blocks.*.attn.attn_drop": "dropout_tp",
        "blocks.*.attn.proj": "rowwise_sp",
        "blocks.*.attn.drop": "dropout_tp",  # on this rank's positions: its own masks too
        "blocks.*.ln2": "sequence",
        "blocks.*.mlp.up": "colwise_sp",
        "blocks.*.mlp.down": "rowwise_sp",
        "blocks.*.mlp.drop": "dropout_tp",
        "ln_f": "sequence",
        "head": "colwise_sp",
    }


__all__ = ["STYLES", "PlanError", "apply_tp", "gpt_plan"]
