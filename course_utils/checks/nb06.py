"""Checks for notebook 06 (tensor parallelism): a row-parallel forward, and the head split."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..comm import CollectiveCounter
from .common import ExerciseError, launch_check, passed, refuse_calls


def _row_worker(ctx, row_parallel_linear, cases):
    t, r = ctx.world_size, ctx.rank
    for b, s, d_in, d_out, with_bias in cases:
        g = torch.Generator().manual_seed(100 * d_in + d_out)  # the same on every rank
        x = torch.randn(b, s, d_in, generator=g, dtype=torch.float64).to(ctx.device)
        w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64).to(ctx.device)
        bias = torch.randn(d_out, generator=g, dtype=torch.float64).to(ctx.device)
        bias = bias if with_bias else None
        want = F.linear(x, w, bias)  # (b, s, d_out)
        x_r, w_r = x.chunk(t, -1)[r].clone(), w.chunk(t, -1)[r].clone()
        where = f"t={t}, x {tuple(x.shape)}, weight {tuple(w.shape)}, bias {'yes' if with_bias else 'None'}"
        with CollectiveCounter() as comm:
            got = row_parallel_linear(x_r, w_r, None if bias is None else bias.clone())
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ExerciseError(
                f"row_parallel_linear (a former exercise 06.1): with {where}, return the whole output {tuple(want.shape)} on every "
                f"rank; got {shape}"
            )
        if comm.counts.get("all_reduce", 0) != 1 or sum(comm.counts.values()) != 1:
            raise ExerciseError(
                f"row_parallel_linear (a former exercise 06.1): with {where}, rank {r} issued {dict(comm.counts) or 'no collective'}; "
                "a row-parallel layer needs exactly one all-reduce of the partial sums"
            )
        err = float((got - want).abs().max())
        if not err <= 1e-10:  # a NaN fails too
            partial = F.linear(x_r, w_r)
            if bias is not None and torch.allclose(got, want + (t - 1) * bias, atol=1e-10):
                hint = "the bias arrived t times: add it once, after the all-reduce"
            elif torch.allclose(got, partial + (bias if bias is not None else 0), atol=1e-10):
                hint = "that is this rank's partial sum: all-reduce it over the ranks"
            else:
                hint = "each rank multiplies its slice of x by its slice of the weight's columns"
            raise ExerciseError(
                f"row_parallel_linear (a former exercise 06.1): with {where}, rank {r}'s output differs from one process by "
                f"{err:.2g}: {hint}."
            )
    dist.barrier()
    return True


def check_row_parallel_linear(row_parallel_linear) -> None:
    """The row-parallel forward (exercise 06.1 before f and g replaced it): ``row_parallel_linear(x_shard, weight_shard, bias)`` on every rank."""
    cases = [(2, 3, 12, 5, True), (1, 4, 24, 7, True), (3, 2, 6, 6, False)]
    for t in (2, 3):
        launch_check(
            "06 (row-parallel forward)",
            _row_worker,
            t,
            row_parallel_linear=row_parallel_linear,
            cases=cases,
            timeout=90,
        )
    passed(
        "06 (row-parallel forward)",
        "equal to one process on 2 and 3 ranks, with one all-reduce and the bias once",
    )


def _reference_shard(wq, wk, wv, bq, bk, bv, rank, t, head_dim):
    a = wq.shape[0] // head_dim
    w = torch.stack([x.view(a, head_dim, -1) for x in (wq, wk, wv)], 1)  # (a, 3, hd, h)
    b = torch.stack([x.view(a, head_dim) for x in (bq, bk, bv)], 1)  # (a, 3, hd)
    heads = slice(rank * a // t, (rank + 1) * a // t)
    return w[heads].reshape(-1, wq.shape[1]), b[heads].reshape(-1)


def check_qkv_shard(qkv_shard) -> None:
    """Exercise 06.2: ``qkv_shard(wq, wk, wv, bq, bk, bv, rank, t, head_dim)``: this rank's rows of
    the fused ``qkv`` layer, whole heads, laid out head by head."""
    cases = [(4, 2, 3), (8, 4, 2), (6, 3, 4), (4, 1, 5), (2, 2, 8)]
    for a, t, hd in cases:
        h = a * hd
        g = torch.Generator().manual_seed(a * 100 + t)
        ws = [torch.randn(h, h, generator=g, dtype=torch.float64) for _ in range(3)]
        bs = [torch.randn(h, generator=g, dtype=torch.float64) for _ in range(3)]
        for rank in range(t):
            want_w, want_b = _reference_shard(*ws, *bs, rank, t, hd)
            with refuse_calls("06.2", [_reference_shard], "write the slicing yourself"):
                got = qkv_shard(*[w.clone() for w in ws], *[b.clone() for b in bs], rank, t, hd)
            where = f"a={a} heads of {hd}, t={t}, rank {rank}"
            if not (isinstance(got, tuple) and len(got) == 2):
                raise ExerciseError(
                    f"exercise 06.2: return (weight, bias); got {type(got).__name__}"
                )
            gw, gb = got
            if tuple(gw.shape) != tuple(want_w.shape) or tuple(gb.shape) != tuple(want_b.shape):
                raise ExerciseError(
                    f"exercise 06.2: with {where}, the weight shard must be (3·h/t, h) = "
                    f"{tuple(want_w.shape)} and the bias (3·h/t,); got {tuple(gw.shape)} and "
                    f"{tuple(gb.shape)}"
                )
            if torch.equal(gw, want_w) and torch.equal(gb, want_b):
                continue
            if torch.equal(gw, want_w):
                hint = "the weight is right, the bias is not: it follows the same layout"
            elif torch.equal(gw.sort(0).values, want_w.sort(0).values):
                hint = (
                    "the right rows in the wrong order: the model reads qkv as (heads, 3, "
                    "head_dim), so each head's q, k and v rows come together"
                )
            else:
                hint = (
                    f"rank {rank} holds heads {rank}·a/t .. ({rank}+1)·a/t − 1, each with its q, k "
                    "and v rows"
                )
            raise ExerciseError(f"exercise 06.2: with {where}, your shard is wrong: {hint}.")
    passed(
        "06.2", f"whole heads in the model's layout for {len(cases)} (heads, t, head size) cases"
    )


__all__ = ["check_qkv_shard", "check_row_parallel_linear"]
