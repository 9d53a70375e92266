"""Notebook 06's exercise checks (the row-parallel forward, 06.1 f and g, 06.2 the head split,
06.3 the vocabulary-parallel loss; on real gloo ranks where they communicate), and the
reference 06.2 compares against.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils import checks
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- the row-parallel forward (06.1 before f and g replaced it; still public) ---------------


def row_parallel_linear(x_shard, weight_shard, bias):
    out = torch.nn.functional.linear(x_shard, weight_shard)
    dist.all_reduce(out)
    return out if bias is None else out + bias


def row_bias_on_every_rank(x_shard, weight_shard, bias):
    out = torch.nn.functional.linear(x_shard, weight_shard, bias)
    dist.all_reduce(out)
    return out


def test_check_row_parallel_linear(capsys):
    checks.check_row_parallel_linear(row_parallel_linear)
    assert "✓ exercise 06 (row-parallel forward)" in capsys.readouterr().out
    fails(checks.check_row_parallel_linear, row_bias_on_every_rank, "the bias arrived t times")


# ---- 06.1 f and g, 06.2 the head split, 06.3 the vocabulary-parallel loss ----------------------


class CopyToTP(torch.autograd.Function):  # the model answers, written apart from the package's
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceInPlace(torch.autograd.Function):  # forgets the copy
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceBothWays(torch.autograd.Function):  # all-reduces the gradient too
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class CopyThatReduces(torch.autograd.Function):  # f with g's forward
    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.multiprocess
def test_06_1_f_and_g(runs_root, capsys):
    checks.check_f_and_g(CopyToTP, ReduceFromTP)
    assert "✓ exercise 06.1" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_06_1_typical_mistakes_and_bypasses(runs_root):
    from course_utils.tensor_parallel import comm

    fails(functools.partial(checks.check_f_and_g, CopyToTP), ReduceInPlace, "in place")
    fails(functools.partial(checks.check_f_and_g, CopyToTP), ReduceBothWays, "g's backward")
    fails(lambda c: checks.check_f_and_g(c, ReduceFromTP), CopyThatReduces, "f's forward")
    fails(lambda c: checks.check_f_and_g(c, comm._ReduceFromTP), CopyToTP, "package's own f / g")

    class Wrapping(torch.autograd.Function):  # the package's f called inside
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return comm._CopyToTP.backward(ctx, grad)[0]

    fails(lambda c: checks.check_f_and_g(c, ReduceFromTP), Wrapping, "package's own f / g")


def qkv_shard(wq, wk, wv, bq, bk, bv, rank, t, head_dim):
    h = wq.shape[1]
    a = wq.shape[0] // head_dim
    w = torch.stack([m.view(a, head_dim, h) for m in (wq, wk, wv)], dim=1)
    b = torch.stack([v.view(a, head_dim) for v in (bq, bk, bv)], dim=1)
    mine = slice(rank * a // t, (rank + 1) * a // t)
    return w[mine].reshape(-1, h), b[mine].reshape(-1)


def test_06_2_qkv_shard_and_mistakes(capsys):
    checks.check_qkv_shard(qkv_shard)
    assert "✓ exercise 06.2" in capsys.readouterr().out

    def gpt2_layout(wq, wk, wv, bq, bk, bv, rank, t, head_dim):  # [Q | K | V], cut contiguously
        w, b = torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv])
        n = w.shape[0] // t
        return w[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n]

    def q_then_k_then_v(wq, wk, wv, bq, bk, bv, rank, t, head_dim):  # the right rows, not by head
        rows = slice(rank * wq.shape[0] // t, (rank + 1) * wq.shape[0] // t)
        return torch.cat([wq[rows], wk[rows], wv[rows]]), torch.cat([bq[rows], bk[rows], bv[rows]])

    fails(checks.check_qkv_shard, gpt2_layout, "heads")
    fails(checks.check_qkv_shard, q_then_k_then_v, "wrong order")


class VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):  # (N, V/t), (N,)
        start = dist.get_rank() * logits.shape[-1]
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top[:, None]
        e = shifted.exp()
        mine = (target >= start) & (target < start + logits.shape[-1])
        idx = (target - start).clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, idx[:, None])[:, 0] * mine
        both = torch.stack([e.sum(-1), picked])
        dist.all_reduce(both)
        ctx.save_for_backward(e / both[0][:, None], idx, mine)
        return both[0].log() - both[1]

    @staticmethod
    def backward(ctx, grad):
        p, idx, mine = ctx.saved_tensors
        g = p.clone()
        g[torch.arange(len(idx)), idx] -= mine.to(g.dtype)
        return g * grad[:, None], None


class GathersTheLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, logits)
        return nn.functional.cross_entropy(torch.cat(parts, -1), target, reduction="none")

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not reached")


class NoMaxShift(VocabParallelCE):  # overflows in float32 with large logits
    @staticmethod
    def forward(ctx, logits, target):
        start = dist.get_rank() * logits.shape[-1]
        e = logits.exp()
        mine = (target >= start) & (target < start + logits.shape[-1])
        idx = (target - start).clamp(0, logits.shape[-1] - 1)
        picked = logits.gather(-1, idx[:, None])[:, 0] * mine
        both = torch.stack([e.sum(-1), picked])
        dist.all_reduce(both)
        ctx.save_for_backward(e / both[0][:, None], idx, mine)
        return both[0].log() - both[1]


class EveryRankItsTarget(VocabParallelCE):  # the target's logit taken on every rank
    @staticmethod
    def forward(ctx, logits, target):
        start = dist.get_rank() * logits.shape[-1]
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top[:, None]
        e = shifted.exp()
        idx = (target - start).clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, idx[:, None])[:, 0]
        both = torch.stack([e.sum(-1), picked])
        dist.all_reduce(both)
        ctx.save_for_backward(e / both[0][:, None], idx, torch.ones_like(target, dtype=torch.bool))
        return both[0].log() - both[1]


class ReducesInBackward(VocabParallelCE):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return VocabParallelCE.backward(ctx, grad / dist.get_world_size())


@pytest.mark.multiprocess
def test_06_3_vocab_parallel_cross_entropy(runs_root, capsys):
    checks.check_vocab_parallel_cross_entropy(VocabParallelCE)
    assert "✓ exercise 06.3" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_06_3_typical_mistakes_and_bypasses(runs_root):
    from course_utils.tensor_parallel import loss

    check = checks.check_vocab_parallel_cross_entropy
    fails(check, GathersTheLogits, "all-reduces only")
    fails(check, NoMaxShift, "overflows")
    fails(check, EveryRankItsTarget, "one rank only")
    fails(check, ReducesInBackward, "backward communicated")
    fails(check, loss._VocabParallelCrossEntropy, "package's own")

    class ThroughThePackage(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            return loss.vocab_parallel_cross_entropy(logits[:, None], target[:, None]).expand(
                len(target)
            )

        @staticmethod
        def backward(ctx, grad):
            return None, None

    fails(check, ThroughThePackage, "package's own")

    class LossParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = init_device_mesh(logits.device.type, (dist.get_world_size(),))
            d = DTensor.from_local(logits, mesh, [Shard(1)])
            return nn.functional.cross_entropy(d, target, reduction="none").to_local()

        @staticmethod
        def backward(ctx, grad):
            return None, None

    fails(check, LossParallel, "loss_parallel")


# ---- the checks' own references and case lists -----------------------------------------------


def _textbook_attention(x, wq, wk, wv, bq, bk, bv, wo, bo, a):
    """Multi-head causal attention from separate Q, K, V matrices whose rows go head by head:
    written here without the course's model or its fused layout."""
    B, T, h = x.shape
    hd = h // a

    def heads(w, b):
        return (x @ w.T + b).view(B, T, a, hd).transpose(1, 2)  # (B, a, T, hd)

    q, k, v = heads(wq, bq), heads(wk, bk), heads(wv, bv)
    scores = (q @ k.transpose(-2, -1)) / hd**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, h)
    return y @ wo.T + bo


@pytest.mark.parametrize("a, t, hd", [(4, 2, 3), (8, 4, 2), (6, 3, 4), (2, 2, 8)])
def test_06_2_reference_runs_the_course_model_as_textbook_attention(a, t, hd):
    """Check 06.2's reference shards, loaded into the course's attention layer on each of t
    "ranks" (row-parallel proj, its bias added once), must compute what textbook attention with the
    separate matrices computes. A reference with the wrong layout would agree with a wrong answer."""
    from course_utils.checks.nb06 import _reference_shard
    from course_utils.models import CausalSelfAttention, GPTConfig

    h = a * hd
    g = torch.Generator().manual_seed(a + 10 * t)
    wq, wk, wv, wo = (torch.randn(h, h, generator=g, dtype=torch.float64) for _ in range(4))
    bq, bk, bv, bo = (torch.randn(h, generator=g, dtype=torch.float64) for _ in range(4))
    x = torch.randn(2, 5, h, generator=g, dtype=torch.float64)
    want = _textbook_attention(x, wq, wk, wv, bq, bk, bv, wo, bo, a)
    cfg = GPTConfig(vocab=8, seq_len=5, d_model=h, n_heads=a, n_layers=1, dropout=0.0)
    total = torch.zeros_like(want)
    for rank in range(t):
        layer = CausalSelfAttention(cfg).double()
        w, b = _reference_shard(wq, wk, wv, bq, bk, bv, rank, t, hd)
        layer.qkv = nn.Linear(h, 3 * h // t).double()
        layer.proj = nn.Linear(h // t, h, bias=False).double()
        with torch.no_grad():
            layer.qkv.weight.copy_(w)
            layer.qkv.bias.copy_(b)
            layer.proj.weight.copy_(wo[:, rank * h // t : (rank + 1) * h // t])  # row parallel
        total += layer(x).detach()
    torch.testing.assert_close(total + bo, want, rtol=1e-12, atol=1e-12)
