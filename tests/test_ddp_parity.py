"""The from-scratch DDP against single-process training: same parameters after every step."""

from __future__ import annotations

import pytest
import torch

from course_utils import RankFailedError, launch
from course_utils.data_parallel import BucketedDDP
from course_utils.data_parallel.parity import parity_worker
from course_utils.models import FrozenMLP, TiedMLP, ToyMLP, UnusedParamMLP

pytestmark = pytest.mark.multiprocess

MODELS = {"mlp": ToyMLP, "tied": TiedMLP, "frozen": FrozenMLP, "unused": UnusedParamMLP}


def small_buckets(m):
    return BucketedDDP(m, bucket_cap_mb=0.002)  # ~2 KB: several buckets even for these toys


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", list(MODELS))
def test_bucketed_ddp_matches_single_process_float64(runs_root, variant, world_size):
    res = launch(
        parity_worker,
        world_size,
        make_model=MODELS[variant],
        wrap=small_buckets,
        steps=4,
        echo=False,
    )
    for rank, diffs in enumerate(res.results):
        assert max(diffs) < 1e-12, (variant, rank, diffs)


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
        max(max(d) for d in res.results) < 1e-5
    )  # float32: summation order matters at ~1e-7 relative


def test_no_sync_gradient_accumulation(runs_root):
    res = launch(
        parity_worker, 2, make_model=TiedMLP, wrap=small_buckets, steps=3, accumulate=4, echo=False
    )
    assert max(max(d) for d in res.results) < 1e-12


def test_frozen_and_unused_parameters_are_not_communicated(runs_root):
    def count(ctx):
        torch.manual_seed(0)
        ddp = BucketedDDP(UnusedParamMLP(), bucket_cap_mb=0.002)
        torch.manual_seed(0)
        frozen = BucketedDDP(FrozenMLP(), bucket_cap_mb=0.002)
        x = torch.randn(4, 16)
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
    assert max(max(d) for d in res.results) < 1e-12


def test_rank_with_different_parameters_is_detected(runs_root):
    def bad_init(ctx):
        torch.manual_seed(ctx.rank)  # the classic bug: a seed per rank before building the model
        BucketedDDP(ToyMLP())

    with pytest.raises(RankFailedError) as info:
        launch(bad_init, 2, echo=False)
    msg = str(info.value)
    assert (
        "start with parameters that differ from rank 0's" in msg and "torch.manual_seed(0)" in msg
    )

    def broadcast_fixes_it(ctx):
        torch.manual_seed(ctx.rank)
        ddp = BucketedDDP(ToyMLP(), init="broadcast")
        return ddp.module.fc1.weight.sum().item()

    res = launch(broadcast_fixes_it, 2, echo=False)
    assert res.results[0] == res.results[1]
