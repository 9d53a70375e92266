"""3D parallelism's pieces of the model and the batch: which blocks each pipeline stage holds
(:func:`stage_bounds`), the stage itself (:class:`GPTStage`, :func:`make_stage`), its TP plan
(:func:`stage_plan`), the shape checks, and the global batches with each DP replica's slice."""

from __future__ import annotations

import torch
from torch import nn

from ..models import GPT, GPTConfig
from ..tensor_parallel import gpt_plan
from .dims import ParallelDims


def stage_bounds(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """Blocks ``[a, b)`` of each of ``pp`` stages: contiguous, sizes differing by at most one, the
    extra blocks on the *middle* stages (the first and last also hold embeddings and head)."""
    if not 1 <= pp <= n_layers:
        raise ValueError(
            f"pp={pp} stages for {n_layers} layers: every stage needs at least one block, "
            f"so pp must be between 1 and {n_layers}"
        )
    base, extra = divmod(n_layers, pp)
    order = sorted(range(pp), key=lambda s: (s in (0, pp - 1), s))  # middle stages first
    sizes = [base + (1 if s in order[:extra] else 0) for s in range(pp)]
    bounds, a = [], 0
    for n in sizes:
        bounds.append((a, a + n))
        a += n
    return bounds


class GPTStage(nn.Module):
    """Stage ``[a, b)`` of a :class:`~course_utils.models.GPT`, sharing its modules.

    Its parameter names are the full model's (``blocks.2.attn.qkv.weight`` stays that), so a plan
    written for the GPT applies to the stage, and each shard finds its reference by name. The first
    stage maps token ids ``(B, T)`` to hidden states ``(B, T, h)``; middle stages map hidden states
    to hidden states; the last stage returns logits ``(B, T, V)`` (``V/t`` with TP).
    """

    def __init__(self, model: GPT, a: int, b: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed, self.pos, self.drop = model.embed, model.pos, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(a, b)})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):  # (B, T) ids or (B, T, h) -> (B, T, h) or (B, T, V)
        if self.first:
            x = self.drop(self.embed(x) + self.pos.weight[: x.shape[1]])
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def stage_plan(first: bool, last: bool) -> dict[str, str]:
    """Megatron's GPT plan (:func:`~course_utils.tensor_parallel.gpt_plan`) for one stage: the
    embedding row only on the first stage, the head only on the last."""

    plan = gpt_plan()
    if not first:
        del plan["embed"]
    if not last:
        del plan["head"]
    return plan


def make_stage(model: GPT, dims: ParallelDims, pp_rank: int) -> GPTStage:
    """Stage ``pp_rank`` of ``model`` (:func:`stage_bounds`), sharing its modules."""
    a, b = stage_bounds(model.cfg.n_layers, dims.pp)[pp_rank]
    return GPTStage(model, a, b, pp_rank == 0, pp_rank == dims.pp - 1)


def check_shape(dims: ParallelDims, cfg: GPTConfig, global_batch: int, micro_batches: int) -> None:
    """Refuse, with the numbers, a shape the GPT or the batch cannot be split into."""
    stage_bounds(cfg.n_layers, dims.pp)
    for what, v in (("n_heads", cfg.n_heads), ("vocab", cfg.vocab)):
        if v % dims.tp:
            raise ValueError(f"tp={dims.tp} must divide the model's {what}={v}")
    if global_batch % (dims.dp * micro_batches):
        raise ValueError(
            f"global batch {global_batch} must split into dp={dims.dp} replicas × "
            f"{micro_batches} micro-batches"
        )


def batches(cfg: GPTConfig, global_batch: int, steps: int, seed: int = 0, device="cpu"):
    """``steps`` global batches ``(x, y)`` of token ids ``(B, T)``, the same on every rank; ``y`` is
    ``x`` shifted by one (next-token prediction)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(cfg.vocab, (global_batch, cfg.seq_len + 1), generator=gen)
        # contiguous, as a data loader hands them out: torch.distributed.pipelining (2.11) checks
        # a stage's input strides against its first micro-batch's and refuses a shifted view
        out.append((ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)))
    return out


def dp_slice(x: torch.Tensor, dims: ParallelDims, dp_rank: int) -> torch.Tensor:
    """DP replica ``dp_rank``'s slice of a global batch."""
    return x.chunk(dims.dp)[dp_rank]
