"""The from-scratch DDP against single-process training: same parameters after every step."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from course_utils import RankFailedError, launch
from course_utils.data_parallel import BucketedDDP
from course_utils.data_parallel.parity import max_param_diff, parity_worker
from course_utils.measure import worst
from course_utils.models import (
    BatchNormMLP,
    FrozenMLP,
    RankDependentMLP,
    TiedMLP,
    ToyMLP,
    UnusedParamMLP,
)

# make test-floor runs these on the oldest torch too: DistributedDataParallel and post-accumulate-grad hooks
pytestmark = [pytest.mark.floor, pytest.mark.multiprocess]

MODELS = {"mlp": ToyMLP, "tied": TiedMLP, "frozen": FrozenMLP, "unused": UnusedParamMLP}


def small_buckets(m):
    return BucketedDDP(m, bucket_cap_mb=0.002)  # ~2 KB: several buckets even for these toys


def _every_variant(ctx, **kw):
    """parity_worker for every model of MODELS in turn, in one launch (one set-up of the ranks)."""
    return {name: parity_worker(ctx, make_model=m, **kw) for name, m in MODELS.items()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_bucketed_ddp_matches_single_process_float64(runs_root, world_size):
    res = launch(_every_variant, world_size, wrap=small_buckets, steps=4, echo=False)
    for rank, per_model in enumerate(res.results):
        assert set(per_model) == set(MODELS)
        for variant, diffs in per_model.items():
            assert worst(diffs) < 1e-12, (variant, rank, diffs)


def test_bucketed_ddp_float32_within_tolerance(runs_root):
    res = launch(
        parity_worker,
        2,
        make_model=ToyMLP,
        wrap=small_buckets,
        steps=4,
        dtype=torch.float32,
        echo=False,
    )
    assert (
        worst(d for r in res.results for d in r) < 1e-5
    )  # float32: summation order matters at ~1e-7 relative


def test_no_sync_gradient_accumulation(runs_root):
    res = launch(
        parity_worker, 2, make_model=TiedMLP, wrap=small_buckets, steps=3, accumulate=4, echo=False
    )
    assert worst(d for r in res.results for d in r) < 1e-12


def test_no_sync_accumulation_weights_uneven_micro_batches_by_their_samples(runs_root):
    # 14 samples on 2 ranks: shards of 7 in micro-batches of 3, 3 and 1 (loss / k would be wrong)
    res = launch(parity_worker, 2, make_model=ToyMLP, wrap=small_buckets, steps=2,
                 global_batch=14, accumulate=3, echo=False)  # fmt: skip
    assert worst(d for r in res.results for d in r) < 1e-12


def test_frozen_and_unused_parameters_are_not_communicated(runs_root):
    def count(ctx):
        torch.manual_seed(0)
        ddp = BucketedDDP(UnusedParamMLP().to(ctx.device), bucket_cap_mb=0.002)
        torch.manual_seed(0)
        frozen = BucketedDDP(FrozenMLP().to(ctx.device), bucket_cap_mb=0.002)
        x = torch.randn(4, 16, device=ctx.device)
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
        return {
            "unused_grad_is_none": ddp.module.unused.weight.grad is None,
            "frozen_in_buckets": sum(
                p is frozen.module.fc1.weight for b in frozen.buckets for p in b.params
            ),
            "buckets": len(ddp.buckets),
        }

    res = launch(count, 2, echo=False)
    assert res.results[0] == {
        "unused_grad_is_none": True,
        "frozen_in_buckets": 0,
        "buckets": res.results[0]["buckets"],
    }
    assert res.results[0]["buckets"] > 1


def test_torch_ddp_passes_the_same_check(runs_root):
    from torch.nn.parallel import DistributedDataParallel as DDP

    res = launch(parity_worker, 2, make_model=ToyMLP, wrap=lambda m: DDP(m), steps=3, echo=False)
    assert worst(d for r in res.results for d in r) < 1e-12


def test_rank_with_different_parameters_is_detected(runs_root):
    def bad_init(ctx):
        torch.manual_seed(ctx.rank)  # the classic bug: a seed per rank before building the model
        BucketedDDP(ToyMLP().to(ctx.device))

    with pytest.raises(RankFailedError) as info:
        launch(bad_init, 2, echo=False)
    msg = str(info.value)
    assert (
        "start with parameters that differ from rank 0's" in msg and "torch.manual_seed(0)" in msg
    )

    def broadcast_fixes_it(ctx):
        torch.manual_seed(ctx.rank)
        ddp = BucketedDDP(ToyMLP().to(ctx.device), init="broadcast")
        return ddp.module.fc1.weight.sum().item()

    res = launch(broadcast_fixes_it, 2, echo=False)
    assert res.results[0] == res.results[1]


# ---- ranks that do not behave alike ---------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("impl", ["bucketed", "torch"])
def test_ranks_that_differ_give_the_mean_with_missing_gradients_as_zero(
    runs_root, world_size, impl
):
    """Even ranks skip ``extra`` and produce a/b gradients in the opposite order to odd ranks.

    Buckets launched as they fill would pair rank 0's ``b`` with rank 1's ``a``; a gradient
    dropped when *any* rank lacks it would leave ``extra`` untrained. Both show up here.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrap = small_buckets if impl == "bucketed" else partial(DDP, find_unused_parameters=True)
    res = launch(
        parity_worker,
        world_size,
        make_model=RankDependentMLP,
        wrap=wrap,
        steps=3,
        rank_dependent=True,
        optimizer="adam",
        lr=0.01,
        timeout=120,
        echo=False,
    )
    for rank, diffs in enumerate(res.results):
        assert worst(diffs) < 1e-12, (impl, rank, diffs)


def test_rank_dependent_model_really_differs_between_ranks():
    """The model used above must make ranks differ, or the test proves nothing."""
    torch.manual_seed(0)
    m = RankDependentMLP().double()
    x = torch.randn(4, 16, dtype=torch.float64)
    orders = {}
    for r in (0, 1):
        m.rank = r
        m.zero_grad(set_to_none=True)
        seen = []
        hooks = [
            p.register_post_accumulate_grad_hook(lambda p, n=n, seen=seen: seen.append(n))
            for n, p in m.named_parameters()
        ]
        m(x).sum().backward()
        for h in hooks:
            h.remove()
        orders[r] = seen
    assert "extra.weight" not in orders[0] and "extra.weight" in orders[1]
    a0, b0 = orders[0].index("a.weight"), orders[0].index("b.weight")
    a1, b1 = orders[1].index("a.weight"), orders[1].index("b.weight")
    assert (a0 < b0) != (a1 < b1), orders


# ---- overlap: buckets in backward order, launched during backward ----------------------------


def bucket_order_and_overlap(ctx):
    from course_utils.data_parallel import ddp as ddp_module

    torch.manual_seed(0)
    net = ToyMLP().to(ctx.device)
    model = BucketedDDP(net, bucket_cap_mb=0.0001)  # ~100 bytes: about a layer per bucket
    total = sum(1 for _ in net.parameters())
    grads_at_launch = []
    original = ddp_module.all_reduce_async

    def recording(buffer, group=None):
        grads_at_launch.append(sum(p.grad is not None for p in net.parameters()))
        return original(buffer, group)

    ddp_module.all_reduce_async = recording
    try:
        net.zero_grad(set_to_none=True)
        model(torch.randn(8, 16, device=ctx.device)).sum().backward()
        model.finish_gradient_synchronization()
    finally:
        ddp_module.all_reduce_async = original
    first = [n for n, p in net.named_parameters() if any(p is q for q in model.buckets[0].params)]
    return {"first_bucket": sorted(first), "grads_at_launch": grads_at_launch, "total": total}


def test_first_bucket_is_the_last_layer_and_starts_during_backward(runs_root):
    res = launch(bucket_order_and_overlap, 2, echo=False)
    for r in res.results:
        assert r["first_bucket"] == ["fc3.bias", "fc3.weight"], r
        # the first all-reduce started while earlier layers still had no gradient: overlap
        assert r["grads_at_launch"][0] < r["total"], r
        assert r["grads_at_launch"] == sorted(set(r["grads_at_launch"])), r  # one by one
        assert len(r["grads_at_launch"]) >= 3, r  # several buckets, launched as backward goes


# ---- buffers ----------------------------------------------------------------------------------


def batchnorm_buffers(ctx, init, steps=3):
    """Rank r starts with running_mean = r; rank 0's statistics must win on every rank."""
    import torch.distributed as dist
    from torch import nn

    def build(fill):
        torch.manual_seed(0)
        m = (
            BatchNormMLP().to(ctx.device, torch.float64).eval()
        )  # eval: BN normalises with its running statistics
        with torch.no_grad():
            m.bn.running_mean.fill_(fill)
            m.bn.running_var.fill_(1.0 + fill)
        return m

    model = BucketedDDP(build(float(ctx.rank)), bucket_cap_mb=0.002, init=init)
    reference = build(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    n, r = dist.get_world_size(), dist.get_rank()
    for _ in range(steps):
        x = torch.randn(16, 16, generator=g, dtype=torch.float64).to(ctx.device)
        y = torch.randint(4, (16,), generator=g).to(ctx.device)
        opt_ref.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.chunk(n)[r]), y.chunk(n)[r]).backward()
        model.finish_gradient_synchronization()
        opt.step()
    return {
        "running_mean": model.module.bn.running_mean.tolist(),
        "diff": max_param_diff(reference, model.module),
    }


@pytest.mark.parametrize("init", ["verify", "broadcast"])
def test_buffers_come_from_rank_0(runs_root, init):
    res = launch(batchnorm_buffers, 2, init=init, echo=False)
    for r in res.results:
        assert set(r["running_mean"]) == {0.0}, r
        assert r["diff"] < 1e-12, r


# ---- no silent wrong answers -----------------------------------------------------------------


def two_backwards(ctx, use_no_sync):
    torch.manual_seed(0)
    model = BucketedDDP(ToyMLP().to(ctx.device, torch.float64), bucket_cap_mb=0.002)
    x = torch.randn(4, 16, dtype=torch.float64, device=ctx.device)
    try:
        if use_no_sync:
            with model.no_sync():
                model(x).sum().backward()
        else:
            model(x).sum().backward()
        model(x).sum().backward()
        model.finish_gradient_synchronization()
    except RuntimeError as e:
        return str(e)
    return "ok"


def test_second_backward_outside_no_sync_raises(runs_root):
    res = launch(two_backwards, 2, use_no_sync=False, echo=False)
    for msg in res.results:
        assert "backward ran twice" in msg and "no_sync" in msg, msg
    assert launch(two_backwards, 2, use_no_sync=True, echo=False).results == ["ok", "ok"]


def permuted_weights(ctx):
    torch.manual_seed(0)
    net = ToyMLP().to(ctx.device)
    if ctx.rank == 1:  # same multiset of values: sums and absolute sums agree, the model does not
        with torch.no_grad():
            net.fc1.weight.copy_(net.fc1.weight.flip(0))
    BucketedDDP(net)


def test_permuted_weights_are_detected(runs_root):
    with pytest.raises(RankFailedError) as info:
        launch(permuted_weights, 2, echo=False)
    assert "differ from rank 0's (first: 'fc1.weight'" in str(info.value)
