"""Cross-entropy over logits sharded by vocabulary, without gathering them (Megatron-LM's
``vocab_parallel_cross_entropy``; torch's ``loss_parallel`` does the same with DTensors).

Each rank holds logits ``(B, T, V/t)`` for its slice of the vocabulary. The loss needs, per token,
the maximum logit, ``sum exp(logit - max)`` and the target's logit: three numbers per token. Two
all-reduces carry them (the max, ``B·T`` numbers; then both sums together, ``2·B·T``; Megatron-LM
sends the sums separately) instead of an all-gather of ``B·T·V`` logits. Backward sends nothing: ``softmax - one_hot`` is computed on each rank's slice.
Taught in notebook 06.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):  # logits (N, V/t) this rank's vocab slice, target (N,)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        v_local = logits.shape[-1]
        start = r * v_local
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        row_max = logits.max(dim=-1).values  # (N,)
        if t > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)  # N numbers
        shifted = logits - row_max.unsqueeze(-1)  # (N, V/t)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # (N,)
        mine = (target >= start) & (target < start + v_local)
        local_t = (target - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        if t > 1:
            both = torch.stack([sum_exp, target_logit])  # (2, N): the two sums in one all-reduce
            dist.all_reduce(both, group=group)
            sum_exp, target_logit = both[0], both[1]
        loss = sum_exp.log() - target_logit  # (N,) per-token loss
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine)
        return loss

    @staticmethod
    def backward(ctx, grad):  # grad (N,)
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax.clone()  # d loss / d logit = softmax - one_hot(target), on this rank's slice
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None):
    """Mean cross-entropy of vocabulary-sharded ``logits`` ``(..., V/t)`` against ``target`` ``(...)``.

    Equal to ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten())`` on one process.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: target must have the "
            "logits' shape without the last (vocabulary) dimension"
        )
    per_token = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group
    )
    return per_token.mean().to(logits.dtype)


__all__ = ["vocab_parallel_cross_entropy"]
