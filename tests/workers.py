"""Importable workers for the tests (the by-value path is tested separately)."""

from __future__ import annotations

import torch


def dtensor_sum(ctx, seed: int = 0) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch < 2.4 kept DTensor under _tensor
        from torch.distributed._tensor import Shard, distribute_tensor

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch.manual_seed(seed)
    full = torch.randn(8, 4).to(ctx.device)
    d = distribute_tensor(full, mesh, [Shard(0)])
    return float((d * 2).full_tensor().sum())


def zero_interface(ctx, impl: str) -> str:
    """A test of torch's ``ZeroRedundancyOptimizer`` interface, run unchanged against ``impl``:
    ``"torch"`` (the real one) or ``"ours"`` (course_utils.zero.ShardedOptimizer). Every rank
    sees the same data (ZeroRedundancyOptimizer alone does not average gradients)."""
    import copy

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from course_utils.zero import ShardedOptimizer

    Z = ZeroRedundancyOptimizer if impl == "torch" else ShardedOptimizer
    dev = ctx.device
    # one parameter, SGD with momentum: the update, zero_grad, the consolidated state
    x = torch.tensor([1.0], device=dev, requires_grad=True)
    o = Z([x], optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    assert torch.equal(x.detach(), torch.tensor([0.9], device=dev)), x
    o.zero_grad()
    assert x.grad is None
    o.consolidate_state_dict(to=0)
    if ctx.rank == 0:
        sd = o.state_dict()
        assert sd["param_groups"][0]["lr"] == 0.1 and sd["param_groups"][0]["momentum"] == 0.9
        assert torch.equal(sd["state"][0]["momentum_buffer"], torch.tensor([1.0], device=dev))
    else:
        try:
            o.state_dict()
            raise AssertionError("state_dict() on a rank that did not receive it")
        except RuntimeError:
            pass
    # a model with two parameter groups (add_param_group), a scheduler changing lr, Adam
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
    head = nn.Linear(4, 3).to(dev)
    ref, ref_head = copy.deepcopy(model), copy.deepcopy(head)
    opt = Z(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    opt.add_param_group({"params": head.parameters(), "lr": 0.02})
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_opt.add_param_group({"params": ref_head.parameters(), "lr": 0.02})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        xb = torch.randn(5, 8, generator=data).to(dev)
        for m, h, op, sc in ((model, head, opt, sched), (ref, ref_head, ref_opt, ref_sched)):
            h(m(xb)).square().mean().backward()
            op.step()
            sc.step()
            op.zero_grad()
    for p, q in zip(
        [*model.parameters(), *head.parameters()], [*ref.parameters(), *ref_head.parameters()]
    ):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    opt.consolidate_state_dict(to=0)
    box = [opt.state_dict() if ctx.rank == 0 else None]
    if ctx.rank == 0:  # the consolidated state is the plain optimizer's state
        want = ref_opt.state_dict()
        got = box[0]
        assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]
        assert sorted(got["state"]) == sorted(want["state"])
        for i, st in want["state"].items():
            for k, v in st.items():
                assert torch.allclose(
                    torch.as_tensor(got["state"][i][k]).float(),
                    torch.as_tensor(v).float(),
                    atol=1e-6,
                ), (i, k)
    dist.broadcast_object_list(box, src=0)
    # loaded into a fresh optimizer, the next step equals the reference's
    fresh = Z(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    fresh.add_param_group({"params": head.parameters(), "lr": 0.02})
    fresh.load_state_dict(box[0])
    xb = torch.randn(5, 8, generator=data).to(dev)
    for m, h, op in ((model, head, fresh), (ref, ref_head, ref_opt)):
        h(m(xb)).square().mean().backward()
        op.step()
    for p, q in zip(
        [*model.parameters(), *head.parameters()], [*ref.parameters(), *ref_head.parameters()]
    ):
        assert torch.allclose(p, q, atol=1e-6), (p - q).abs().max()
    return "ok"


def zero2_overlap(ctx) -> dict:
    """Stage 2 with small buckets: how many reduce-scatters were launched before backward reached
    the first layer, and whether any gradient is left on the parameters afterwards."""
    from torch import nn

    from course_utils.zero import ShardedGradientOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).to(ctx.device)
    opt = ShardedGradientOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, bucket_cap_mb=32 * 33 * 4 / 2**20
    )
    seen = {}
    first = model[0].weight

    def note(grad):
        seen.setdefault("launched", len(opt._pending))

    first.register_hook(note)
    model(torch.randn(4, 32, device=ctx.device)).sum().backward()
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    opt.step()
    return {
        "launched_before_first_layer": seen["launched"],
        "buckets": len(opt.buckets[0]),
        "grads_left": left,
    }


def zero3_peak(ctx, units: str) -> dict:
    """Stage 3 on a stack of linear layers: the most parameter bytes this rank held at once in
    forward and backward, for ``units`` "layer" (each Linear) or "model" (one unit)."""
    from torch import nn

    from course_utils.measure import storage_bytes
    from course_utils.zero import ShardedModel

    torch.manual_seed(0)
    widths = [16, 64, 32, 16, 8]
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])]).to(ctx.device)
    sizes = [sum(p.numel() for p in m.parameters()) for m in model]
    sharded = ShardedModel(model, units=list(model) if units == "layer" else [model])
    peak = [0]

    def measure(*_):
        held = storage_bytes([*sharded.parameters(), *model.parameters()])
        peak[0] = max(peak[0], sum(held.values()))

    def on_output(m, args, out):  # after ShardedModel's hook: ours runs after its gather
        out.register_hook(lambda g: measure())

    for m in model:  # registered after ShardedModel's: they see the unit gathered
        m.register_forward_pre_hook(lambda *a: measure())
        m.register_forward_hook(on_output)
    sharded(torch.randn(4, 16, device=ctx.device)).sum().backward()
    sharded.finish_gradient_synchronization()
    return {
        "peak": peak[0],
        "sizes": sizes,
        "after": sum(storage_bytes(model.parameters()).values()),
    }
