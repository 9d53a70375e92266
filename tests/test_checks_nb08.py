"""Notebook 08's exercise checks (08.1 shard bounds, 08.2 ZeRO stage 1's step, 08.3 stage 3; the
last two on real gloo ranks), and the cases the checks promise to try.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils import checks
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- 08.1 the padding arithmetic, 08.2 stage 1's step -----------------------------------------


def shard_bounds(numel, n, rank):
    shard = -(-numel // n)
    return rank * shard, (rank + 1) * shard, shard * n - numel


def test_08_1_shard_bounds(capsys):
    checks.check_shard_bounds(shard_bounds)
    assert "✓ exercise 08.1" in capsys.readouterr().out


def test_08_1_typical_mistakes():
    def floor_division(numel, n, rank):  # drops the remainder: the shards miss numbers
        s = numel // n
        return rank * s, (rank + 1) * s, 0

    def padding_per_rank(numel, n, rank):
        s = -(-numel // n)
        return rank * s, (rank + 1) * s, s - numel // n

    fails(checks.check_shard_bounds, floor_division, "round up")
    fails(checks.check_shard_bounds, padding_per_rank, "the padded buffer is n shards long")


def via_package(numel, n, rank):
    from course_utils.zero import flat

    s = flat.padded_numel(numel, n) // n
    return rank * s, (rank + 1) * s, flat.padded_numel(numel, n) - numel


def test_08_1_the_package_is_refused():
    fails(checks.check_shard_bounds, via_package, "without course_utils.zero.flat")


def zero1_step(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad, flat_grads)
    shard.grad = grad / dist.get_world_size()
    optimizer.step()
    dist.all_gather_into_tensor(flat_params, shard.detach().clone())


def zero1_sum(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad, flat_grads)
    shard.grad = grad  # the sum, not the mean
    optimizer.step()
    dist.all_gather_into_tensor(flat_params, shard.detach().clone())


def zero1_all_reduce(flat_params, flat_grads, shard, optimizer):
    n, r = dist.get_world_size(), dist.get_rank()
    dist.all_reduce(flat_grads)
    s = flat_grads.numel() // n
    shard.grad = flat_grads[r * s : (r + 1) * s] / n
    optimizer.step()
    dist.all_gather_into_tensor(flat_params, shard.detach().clone())


def zero1_no_gather(flat_params, flat_grads, shard, optimizer):
    grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad, flat_grads)
    shard.grad = grad / dist.get_world_size()
    optimizer.step()


@pytest.mark.multiprocess
def test_08_2_zero1_step(runs_root, capsys):
    checks.check_zero1_step(zero1_step)
    assert "✓ exercise 08.2" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_08_2_typical_mistakes(runs_root):
    fails(checks.check_zero1_step, zero1_sum, "did you divide by n", ["tensor("])
    fails(checks.check_zero1_step, zero1_all_reduce, "though it updates only its shard")
    fails(checks.check_zero1_step, zero1_no_gather, "updated shard must reach every rank once")


# ---- 08.3 stage 3 -----------------------------------------------------------------------------


class Zero3:  # the model answer (the notebook's, with the exercise's methods filled in)
    def __init__(self, model, optimizer_class, options):
        from course_utils.zero.flat import Bucket

        self.n, r = dist.get_world_size(), dist.get_rank()
        self.model, self.units = model, []
        layers = [
            m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        for layer in layers:
            params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
            bucket = Bucket.of(params, self.n)
            flat = bucket.flatten([p.detach() for p in params])
            lo, hi = bucket.shard_range(r)
            unit = {"bucket": bucket, "flat": flat, "shard": nn.Parameter(flat[lo:hi].clone())}
            unit["arrived"] = 0
            for p, view in zip(params, bucket.views(flat)):
                p.data = view
            self.free(unit)
            self.units.append(unit)
            layer.register_forward_pre_hook(lambda m, args, u=unit: self.gather(u))
            layer.register_forward_hook(lambda m, args, out, u=unit: self.after_forward(u, out))
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self.arrived(u))
        self.optimizer = optimizer_class([u["shard"] for u in self.units], **options)

    def gather(self, u):
        flat = u["flat"]
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            dist.all_gather_into_tensor(flat, u["shard"].detach())

    def free(self, u):
        u["flat"].untyped_storage().resize_(0)

    def after_forward(self, u, out):
        self.free(u)
        if out.requires_grad:
            out.register_hook(lambda grad: self.gather(u))

    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            out = torch.empty(bucket.shard_numel, dtype=grads.dtype, device=grads.device)
            dist.reduce_scatter_tensor(out, grads)
            u["shard"].grad = out / self.n
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0
            self.free(u)

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()

    def full_parameters(self):
        out = {}
        for u in self.units:
            self.gather(u)
            for p in u["bucket"].params:
                out[id(p)] = p.detach().clone()
            self.free(u)
        return {name: out.get(id(p), p.detach()) for name, p in self.model.named_parameters()}


class Zero3KeepsEverything(Zero3):  # gathers once, never frees after forward or backward
    def after_forward(self, u, out):
        pass

    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            out = torch.empty(bucket.shard_numel, dtype=grads.dtype, device=grads.device)
            dist.reduce_scatter_tensor(out, grads)
            u["shard"].grad = out / self.n
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0


class Zero3AllReduce(Zero3):  # all-reduces the full gradients, then keeps its shard
    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            dist.all_reduce(grads)
            lo, hi = bucket.shard_range(dist.get_rank())
            u["shard"].grad = grads[lo:hi] / self.n
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0
            self.free(u)


class Zero3Sum(Zero3):  # the sum of the gradients, not the mean
    def arrived(self, u):
        u["arrived"] += 1
        bucket = u["bucket"]
        if u["arrived"] == len(bucket.params):
            grads = bucket.flatten([p.grad for p in bucket.params])
            out = torch.empty(bucket.shard_numel, dtype=grads.dtype, device=grads.device)
            dist.reduce_scatter_tensor(out, grads)
            u["shard"].grad = out
            for p in bucket.params:
                p.grad = None
            u["arrived"] = 0
            self.free(u)


class Zero3FromThePackage:
    def __init__(self, model, optimizer_class, options):
        from course_utils.zero import ShardedModel

        self.sharded = ShardedModel(model)
        self.optimizer = optimizer_class(self.sharded.parameters(), **options)

    def step(self):
        self.sharded.finish_gradient_synchronization()
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()

    def full_parameters(self):
        return self.sharded.full_parameters()


@pytest.mark.multiprocess
def test_08_3_zero3(runs_root, capsys):
    checks.check_zero3(Zero3)
    assert "✓ exercise 08.3" in capsys.readouterr().out


@pytest.mark.multiprocess
@pytest.mark.slow  # wrong answers: make test runs them; the floor runs the check itself
def test_08_3_typical_mistakes_and_bypasses(runs_root):
    fails(checks.check_zero3, Zero3KeepsEverything, "free each unit")
    fails(checks.check_zero3, Zero3AllReduce, "needs no all-reduce")
    fails(checks.check_zero3, Zero3Sum, "divided by n")
    fails(checks.check_zero3, Zero3FromThePackage, "package's own stage 3")


# ---- the checks' own references and case lists -----------------------------------------------


class _Spy:
    """A right answer that also writes down what the check asked it: the cases the check covers."""

    def __init__(self, answer, log):
        self.answer, self.log = answer, str(log)

    def __call__(self, *args):
        import json

        world = dist.get_world_size() if dist.is_initialized() else None
        seen = [list(a.shape) if torch.is_tensor(a) else a for a in args[:3]]
        with open(self.log, "a") as f:
            f.write(json.dumps([*seen, world]) + "\n")
        return self.answer(*args)


def _asked(log) -> list:
    import json

    return [json.loads(line) for line in log.read_text().splitlines()]


def test_08_1_cases_cover_what_the_docstring_promises(tmp_path):
    """08.1 promises uneven splits, fewer elements than ranks and one rank: its cases include them."""
    log = tmp_path / "asked.jsonl"
    checks.check_shard_bounds(_Spy(shard_bounds, log))
    asked = [(numel, n) for numel, n, _rank, _world in _asked(log)]
    assert any(numel % n for numel, n in asked)  # padding needed
    assert any(numel < n for numel, n in asked)  # ranks left with padding only
    assert any(n == 1 for _, n in asked) and any(numel % n == 0 for numel, n in asked)


@pytest.mark.multiprocess
def test_08_2_still_tries_an_uneven_padded_split_on_3_ranks(runs_root, tmp_path):
    """ToyMLP's 1732 parameters do not split over 3 ranks: the flat buffer is padded to 1734. An
    answer that only works without padding must meet that case."""
    from course_utils.models import ToyMLP

    psi = sum(p.numel() for p in ToyMLP().parameters())
    log = tmp_path / "asked.jsonl"
    checks.check_zero1_step(_Spy(zero1_step, log))
    asked = {(tuple(flat), world) for flat, _grads, _shard, world in _asked(log)}
    assert ((psi + (-psi) % 3,), 3) in asked and psi % 3, asked  # padded on 3 ranks
    assert any(world == 2 for _, world in asked)
