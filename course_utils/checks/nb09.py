"""Checks for notebook 09 (context parallelism): the online-softmax merge (09.1), ring attention's
forward (09.2), and Ulysses' all-to-all from sequence to heads (09.3)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..comm.counting import CommunicationMode
from ..context_parallel import comm, ring, softmax, ulysses
from ..context_parallel.layout import positions, shard
from .common import (
    OnlyCommunication,
    fail,
    launch_check,
    no_store,
    passed,
    patched_methods,
    refuse_calls,
)

PACKAGE_MERGE = (
    "that is the package's merge (course_utils.context_parallel.merge), which the check compares "
    "with: write the rescaling yourself"
)
PACKAGE_RING = (
    "that is the package's ring attention (course_utils.context_parallel), which the check "
    "compares with: write the loop and its sends yourself"
)
PACKAGE_A2A = (
    "that is the package's seq_to_head (course_utils.context_parallel.comm), which the check "
    "compares with: write the reshapes and the all-to-all yourself"
)


def _merge_cases():
    g = torch.Generator().manual_seed(91)
    out = []
    for dtype, scale in ((torch.float64, 1.0), (torch.float64, 3.0), (torch.float32, 60.0)):
        q = torch.randn(2, 3, 6, 4, generator=g, dtype=dtype) * scale
        k = torch.randn(2, 3, 10, 4, generator=g, dtype=dtype) * scale
        v = torch.randn(2, 3, 10, 4, generator=g, dtype=dtype)
        out.append((q, k, v, torch.arange(4, 10), torch.arange(10)))  # causal, queries late
        out.append((q, k, v, torch.arange(6), torch.arange(10)))  # early rows see nothing of B
    return out


TORCH_MERGE = (
    "that is torch's own context-parallel merger (_SDPAMerger): write the rescaling yourself"
)


def _torch_mergers() -> list:
    """torch's merger of partial attention results, where this torch has one."""
    import importlib

    found = []
    for module in ("torch.distributed.tensor.experimental._context_parallel._attention",
                   "torch.distributed.tensor.experimental._attention"):  # fmt: skip
        try:
            merger = getattr(importlib.import_module(module), "_SDPAMerger", None)
        except ImportError:
            continue
        if merger is not None and merger not in found:
            found.append(merger)
    return found


def check_merge(merge) -> None:
    """Exercise 09.1: ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``."""
    cases = []  # computed before the student's code runs: the package's blocks use its merge
    for q, k, v, q_pos, k_pos in _merge_cases():
        want = softmax.attention(q.double(), k.double(), v.double(), True, q_pos, k_pos)
        cut = 3 + len(q_pos) % 4  # keys split in two blocks, A and B
        a = softmax.causal_block_attention(q, k[..., :cut, :], v[..., :cut, :], q_pos, k_pos[:cut])
        b = softmax.causal_block_attention(q, k[..., cut:, :], v[..., cut:, :], q_pos, k_pos[cut:])
        top = float((q @ k.transpose(-2, -1)).abs().max()) * q.shape[-1] ** -0.5  # scaled scores
        cases.append((q.dtype, top, want, a[:2], b[:2], bool(torch.isinf(b[1]).any())))
    x = torch.randn(1, 1, 2, 2, dtype=torch.float64)
    blind = softmax.block_attention(x, x, x, torch.zeros(2, 2, dtype=torch.bool))
    with contextlib.ExitStack() as watch:
        watch.enter_context(refuse_calls("09.1", [softmax.merge], PACKAGE_MERGE))
        watch.enter_context(refuse_calls("09.1", _torch_mergers(), TORCH_MERGE))
        for dtype, top, want, a, b, has_blind in cases:
            for first, second in ((a, b), (b, a)):
                got = merge(first[0], first[1], second[0], second[1])
                if not (isinstance(got, tuple) and len(got) == 2):
                    fail("09.1", "return a pair (out, lse)")
                out, lse = got
                where = f"{dtype}, scores up to {top:.0f}"
                if not torch.isfinite(out).all():
                    hint = (
                        "a row that sees no key in one block has lse = -inf there; "
                        "exp(-inf - (-inf)) is nan: handle it"
                        if has_blind and dtype == torch.float64
                        else "exp of a large score overflows: subtract the larger lse first"
                    )
                    fail("09.1", f"with {where}, your output has inf or nan: {hint}")
                tol = 1e-12 if dtype == torch.float64 else 1e-4
                err = float((out.double() - want).abs().max())
                if not err <= tol:  # a NaN fails too
                    fail("09.1", f"with {where}, the merged output differs from attention over "
                         f"both blocks by {err:.2g}: weight each block's output by exp(its lse "
                         "minus the merged lse)")  # fmt: skip
                want_lse = torch.logaddexp(first[1].double(), second[1].double())
                finite = torch.isfinite(want_lse)
                if not (
                    torch.equal(torch.isfinite(lse), finite)
                    and torch.allclose(lse.double()[finite], want_lse[finite], atol=tol)
                ):
                    fail("09.1", "the merged lse is wrong: it is the log of the sum of both "
                         "blocks' exp-sums")  # fmt: skip
        out, lse = merge(blind[0], blind[1], blind[0], blind[1])  # both blocks blind
        if out.isnan().any() or not torch.isinf(lse).all():
            fail("09.1", "a row that sees no key in either block must stay out = 0, lse = -inf "
                 "(not nan)")  # fmt: skip
    top32 = max((top for dtype, top, *_ in cases if dtype == torch.float32), default=0.0)
    passed("09.1", "equal to one softmax over both blocks (float64 to 1e-12; float32 to 1e-4 with "
           f"scores up to {top32:,.0f}), rows that see nothing handled")  # fmt: skip


def _ring_worker(ctx, ring_forward, cases, subgroup=None):
    """Every case on the whole world (group None), then, with ``subgroup`` (global ranks), the
    same cases on a CP group whose group ranks differ from the global ones."""
    world = list(range(ctx.world_size))
    _ring_cases(ctx, ring_forward, cases, None, world)
    if subgroup is not None:
        group = dist.new_group(subgroup)  # every rank creates it, members or not
        if ctx.rank in subgroup:
            _ring_cases(ctx, ring_forward, cases, group, subgroup)
    dist.barrier()
    return True


class _OneBlockAtATime(OnlyCommunication):
    """OnlyCommunication (send and receive only), and fails as soon as any operation produces
    scores of this rank's queries against more keys than one block holds."""

    def __init__(self, rows: int, keys: int):
        super().__init__("09.2", ("send", "recv_"), "ring attention passes K and V to the next "
                         "rank with point-to-point sends only")  # fmt: skip
        self.rows, self.keys = rows, keys

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if getattr(func, "namespace", "") == "aten":
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (
                    isinstance(t, torch.Tensor)
                    and t.dim() >= 3
                    and t.shape[-2] == self.rows
                    and t.shape[-1] > self.keys
                ):
                    fail("09.2", f"your code made a {tuple(t.shape)} tensor ({func}): scores of "
                         f"this rank's {self.rows} queries against {t.shape[-1]} keys at once, "
                         f"more than one block holds ({self.keys}). Ring attention attends to one "
                         "block per step and merges it into the running result with the online "
                         "softmax (09.1), so a rank never holds more than the block it works on "
                         "and the one arriving")  # fmt: skip
        return out


def _global_peers(members, me):
    """While the ring runs on a CP group: a P2POp whose peer is not another member's global rank
    fails with what went wrong (a group rank where P2POp takes a global one), before torch's own
    error about a rank outside the group or a send to oneself."""

    def make(init):
        def checked(self, op, tensor, peer=None, group=None, *args, **kwargs):
            if peer is not None and (peer not in members or peer == me):
                fail("09.2", f"global rank {me} posted a P2POp with peer {peer}, which is not "
                     f"another rank of its CP group (global ranks {members}): P2POp takes global "
                     "ranks, also inside a group; dist.get_global_rank(group, i) converts the "
                     "group rank i")  # fmt: skip
            return init(self, op, tensor, peer, group, *args, **kwargs)

        return checked

    return patched_methods(dist.P2POp, {"__init__": make})


def _ring_cases(ctx, ring_forward, cases, group, members):
    n, r = len(members), members.index(ctx.rank)
    refs = [ring.RingAttention, ring.ring_attention, comm.Ring]
    on = "the world" if group is None else f"a CP group of global ranks {members}"
    for layout, B, H, S, D in cases:
        pos = positions(layout, n, S)
        g = torch.Generator().manual_seed(S + H)  # the same whole tensors on every rank
        q, k, v = (
            torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(ctx.device)
            for _ in range(3)
        )
        want = shard(softmax.attention(q, k, v, True), pos[r], 2)
        ql, kl, vl = (shard(t, pos[r], 2) for t in (q, k, v))
        kv_bytes = (kl.numel() + vl.numel()) * kl.element_size()
        sent = []
        with contextlib.ExitStack() as watch:
            watch.enter_context(refuse_calls("09.2", refs, PACKAGE_RING))
            watch.enter_context(no_store("09.2"))
            if group is not None:
                watch.enter_context(_global_peers(members, ctx.rank))
            comm_ = watch.enter_context(_OneBlockAtATime(ql.shape[-2], kl.shape[-2]))
            _count_sends(watch, sent)
            got = ring_forward(ql, kl, vl, pos, group)
        where = f"{n} ranks on {on}, {layout} layout, S={S}"
        if not isinstance(got, torch.Tensor) or got.shape != ql.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            fail("09.2", f"with {where}, return this rank's output {tuple(ql.shape)}; got {shape}")
        err = float((got - want).abs().max())
        if not err <= 1e-12:  # a NaN fails too
            fail("09.2", f"with {where}, rank {r}'s output differs from full causal attention by "
                 f"{err:.2g}: each step attends to the block held (positions pos[src], src = "
                 "(rank - step) mod n) and merges it")  # fmt: skip
        if comm_.calls.get("send", 0) == 0 and n > 1:
            fail("09.2", "no point-to-point send: K and V must travel around the ring")
        if sum(sent) != (n - 1) * kv_bytes:
            fail("09.2", f"with {where}, rank {r} sent {sum(sent)} bytes; the ring passes its K "
                 f"and V n - 1 = {n - 1} times, {(n - 1) * kv_bytes} bytes (no more: the last "
                 "block needs no further hop)")  # fmt: skip


class _Sends(CommunicationMode):
    """Appends the bytes of every point-to-point send to ``sent``."""

    def __init__(self, sent: list):
        super().__init__()
        self.sent = sent

    def before(self, call) -> None:
        if call.namespace == "c10d" and call.name == "send":
            self.sent.append(sum(t.numel() * t.element_size() for t in call.args[0]))


def _count_sends(watch, sent):
    watch.enter_context(_Sends(sent))


def check_ring_forward(ring_forward) -> None:
    """Exercise 09.2: ``ring_forward(q, k, v, pos, group) -> out`` on every rank."""
    cases = [("contiguous", 2, 2, 12, 4), ("zigzag", 1, 3, 24, 2), ("zigzag", 2, 2, 12, 3)]
    launch_check("09.2", _ring_worker, 2, ring_forward=ring_forward, cases=cases, timeout=120)
    launch_check("09.2", _ring_worker, 3, ring_forward=ring_forward, cases=cases, subgroup=[1, 2],
                 timeout=120)  # fmt: skip
    passed("09.2", "equal to full causal attention on 2 and 3 ranks and on a CP group of global "
           "ranks [1, 2], both layouts, one block of scores at a time, K and V passed n - 1 times "
           "by point-to-point sends")  # fmt: skip


def _a2a_worker(ctx, seq_to_head):
    p, r = ctx.world_size, ctx.rank
    for B, H, S, D in ((2, 4, 8, 3), (1, 8, 16, 2)):
        g = torch.Generator().manual_seed(H * S)
        x = torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(ctx.device)
        mine = x[:, :, r * S // p : (r + 1) * S // p].contiguous()
        want = x[:, r * H // p : (r + 1) * H // p]
        with contextlib.ExitStack() as watch:
            watch.enter_context(
                refuse_calls(
                    "09.3",
                    [
                        comm.seq_to_head,
                        comm._seq_to_head,
                        comm.head_to_seq,
                        comm._head_to_seq,
                        ulysses.ulysses_attention,
                    ],  # fmt: skip
                    PACKAGE_A2A,
                )  # fmt: skip
            )
            watch.enter_context(no_store("09.3"))
            c = watch.enter_context(
                OnlyCommunication(
                    "09.3",
                    ("alltoall_base_", "alltoall_", "all_to_all_single"),
                    "one all-to-all moves everything",
                )  # fmt: skip
            )
            got = seq_to_head(mine, None)
        where = f"{p} ranks, x {tuple(x.shape)} (B, H, S, D)"
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            fail("09.3", f"with {where}, rank {r} must return (B, H/P, S, D) = "
                 f"{tuple(want.shape)}; got {shape}")  # fmt: skip
        if sum(c.calls.values()) != 1:
            fail("09.3", f"with {where}, {dict(c.calls) or 'no collective'}: use exactly one "
                 "all-to-all (all_to_all_single, or all_to_all of a list)")  # fmt: skip
        if not torch.equal(got, want):
            heads_ok = torch.equal(got.sort(-2).values, want.sort(-2).values)
            hint = (
                "the tokens are out of order: rank j's piece of the sequence comes j-th"
                if heads_ok
                else "rank r must end with heads r·H/P .. (r+1)·H/P - 1 of every token: the "
                "chunk sent to rank j holds rank j's heads"
            )
            fail("09.3", f"with {where}, rank {r}'s result is wrong: {hint}")
    dist.barrier()
    return True


def check_seq_to_head(seq_to_head) -> None:
    """Exercise 09.3: ``seq_to_head(x, group)``: (B, H, S/P, D) -> (B, H/P, S, D)."""
    for p in (2, 4):
        launch_check("09.3", _a2a_worker, p, seq_to_head=seq_to_head, timeout=90)
    passed("09.3", "every rank ends with its heads over the whole sequence, in order, with one "
           "all-to-all, on 2 and 4 ranks")  # fmt: skip


__all__ = ["check_merge", "check_ring_forward", "check_seq_to_head"]
