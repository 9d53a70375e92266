"""Pipeline parallelism: the simulator against closed forms, partitioning, bad input, equivalence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_utils import launch
from course_utils.compat import pipelining_unsupported
from course_utils.measure import worst
from course_utils.models import pipeline_mlp
from course_utils.pipeline import partition as partition_module
from course_utils.pipeline.parity import pipeline_worker
from course_utils.pipeline.partition import balanced_split, boundary_shapes, partition, time_costs
from course_utils.pipeline.run import check_pipeline
from course_utils.pipeline.run import run_pipeline as _run_pipeline
from course_utils.pipeline.simulate import schedule_order, simulate, theory_bubble

# make test-floor runs these on the oldest torch too: torch.distributed.pipelining
pytestmark = [pytest.mark.floor]


def run_pipeline(*args, **kwargs):
    """run_pipeline with a launch timeout well under pytest's 300 s: a hang fails with every
    rank's stack from the launcher, not with pytest's bare timeout."""
    return _run_pipeline(*args, launch_kwargs={"timeout": 90}, **kwargs)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 1), (4, 4), (4, 8), (8, 16), (3, 5)])
def test_bubble_matches_closed_form(name, p, m):
    s = simulate(name, p, m)
    assert s.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert s.total == pytest.approx((m + p - 1) * 3.0)  # t_f = 1, t_b = 2
    assert len(s.timeline) == 2 * p * m


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 6, 3)])
def test_interleaving_shrinks_the_bubble_by_v(p, m, v):
    s = simulate("interleaved", p, m, v)
    assert s.bubble == pytest.approx(theory_bubble(p, m, v), abs=1e-12)
    assert s.bubble < simulate("1f1b", p, m).bubble


def test_peak_in_flight_gpipe_m_1f1b_at_most_p():
    p, m = 4, 8
    assert simulate("gpipe", p, m).peak_in_flight == [m] * p
    assert simulate("1f1b", p, m).peak_in_flight == [
        4,
        3,
        2,
        1,
    ]  # p - s on stage s, never more than p
    assert max(simulate("1f1b", 4, 2).peak_in_flight) == 2  # and never more than m


def test_unequal_backward_time_and_bad_arguments():
    s = simulate("1f1b", 2, 4, t_f=1, t_b=1)
    assert s.bubble == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="multiple of p"):
        simulate("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate("zigzag", 2, 2)


def test_balanced_split_and_partition():
    assert balanced_split([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balanced_split([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 9)]
    model = pipeline_mlp(depth=7)  # 8 layers: the first is 16x64, the others 64x64 (and the head)
    bounds = partition(model, 4)
    assert len(bounds) == 4 and bounds[0][0] == 0 and bounds[-1][1] == 8
    assert all(a < b for a, b in bounds)
    shapes = boundary_shapes(model, bounds, torch.zeros(5, 16))
    assert shapes[-1] == (5, 4) and all(s == (5, 64) for s in shapes[:-1])
    timed = partition(model, 2, by="time", sample=torch.randn(8, 16))
    assert timed[0][0] == 0 and timed[-1][1] == 8


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(p=12, m=2, global_batch=16), ValueError, "only 9 layers: use at most 9 stages"),
        (dict(p=2, m=3, global_batch=16), ValueError, "does not split into m=3"),
        (dict(p=2, m=4, global_batch=16, schedule="naive"), ValueError, "m must be 1"),
        (
            dict(p=2, m=3, global_batch=12, schedule="torch_interleaved", v=2),
            ValueError,
            "multiple of p",
        ),
        (dict(p=2, m=2, global_batch=16, schedule="zigzag"), ValueError, "unknown schedule"),
        (
            dict(p=2, m=4, global_batch=16, schedule="torch_interleaved", v=8),
            ValueError,
            "16 virtual stages, but the model has only 9 layers",
        ),
        (dict(p=2, m=4, global_batch=16, schedule="1f1b", v=2), ValueError, "needs schedule="),
        (
            dict(p=2, m=2, global_batch=16, world_size=4),
            ValueError,
            "world_size=4 does not match 2 stages",
        ),
    ],
)
def test_bad_input_before_any_process(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        check_pipeline(pipeline_mlp, **kwargs)


def test_interleaving_beyond_the_layers_is_refused_before_any_process(runs_root):
    with pytest.raises(ValueError, match="virtual stages"):
        _run_pipeline(pipeline_mlp, "torch_interleaved", p=2, m=4, v=8)
    assert not runs_root.exists() or not any(runs_root.iterdir())


# The 1F1B order written out by hand (PipeDream-Flush, Narayanan et al. 2021): stage s runs
# min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward, then drains.
ONE_F_ONE_B = {
    (2, 3): ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"],
    (3, 4): ["F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    (4, 2): ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"],
    (2, 1): ["F0 B0", "F0 B0"],
}


@pytest.mark.parametrize("p, m", list(ONE_F_ONE_B))
def test_1f1b_order_matches_the_hand_written_table(p, m):
    got = [" ".join(f"{a.kind}{a.micro}" for a in acts) for acts in schedule_order("1f1b", p, m, 1)]
    assert got == ONE_F_ONE_B[(p, m)]


def test_time_costs_synchronizes_and_leaves_gradients_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(partition_module, "synchronize", lambda device: calls.append(device))
    model = pipeline_mlp(depth=3)
    layers = list(model)
    model(torch.randn(4, 16)).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    costs = time_costs(layers, torch.randn(8, 16), rounds=3)
    assert len(costs) == len(layers) and all(c > 0 for c in costs)
    assert len(calls) == 2 * 3 * len(layers)  # before and after every timed forward + backward
    assert all(torch.device(d) == torch.device("cpu") for d in calls)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n  # not the measurement's accumulated gradients
    fresh = pipeline_mlp(depth=3)
    time_costs(list(fresh), torch.randn(8, 16), rounds=2)
    assert all(p.grad is None for p in fresh.parameters())
    with_bn = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    stats = with_bn[1].running_mean.clone()
    time_costs(list(with_bn), torch.randn(8, 16) + 3.0, rounds=2)
    assert torch.equal(with_bn[1].running_mean, stats)  # the timing passes left no trace


def test_stage_actions_wait_for_the_gpu_stream_not_the_whole_device(monkeypatch):
    """On CUDA each action's label must end when its kernels have run: the runner waits for its
    compute stream after the action (and after each receive), never with a device-wide
    synchronize, which would also wait for sends in flight to a neighbour. Played on the CPU with
    a one-stage pipeline whose runner believes it is on cuda:0."""
    from course_utils.pipeline.schedules import StageRunner

    waits = []

    class Stream:
        def synchronize(self):
            waits.append(len(log))

    log = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("device-wide sync"))
    module = nn.Sequential(nn.Linear(4, 3))
    module.register_forward_hook(lambda *a: log.append("F"))
    x, y = torch.randn(8, 4), torch.randint(3, (8,))
    runner = StageRunner(module, 0, 1, None, None, torch.float32, torch.device("cuda", 0),
                         nn.functional.cross_entropy)  # fmt: skip
    runner.forward(0, x, y, 1)
    assert waits == [1]  # after the forward's kernels were queued
    runner.backward(0)
    assert waits == [1, 1] and module[0].weight.grad is not None
    cpu = StageRunner(module, 0, 1, None, None, torch.float32, torch.device("cpu"),
                      nn.functional.cross_entropy)  # fmt: skip
    cpu.forward(0, x, y, 1)
    cpu.backward(0)
    assert waits == [1, 1]  # nothing to wait for on the CPU


def test_recv_label_moves_an_action_start_to_the_data_arrival(tmp_path):
    """stage_events reads the runtime's pipeline:recv label: waiting for a neighbour is bubble."""
    import json

    from course_utils.pipeline.measure import measured_bubble, stage_events
    from course_utils.profiling.trace import load_trace

    def ev(name, ts, dur, cat="user_annotation"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    events = [
        ev("ProfilerStep#2", 0, 10_000),
        ev("pipeline:F0", 1_000, 4_000),
        ev("pipeline:recv", 1_000, 3_000),  # waited 3 ms for the activation
        ev("aten::mm", 4_100, 800, cat="cpu_op"),
        ev("pipeline:B0", 6_000, 2_000),
    ]
    path = tmp_path / "rank1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events,
                                "distributedInfo": {"rank": 1, "world_size": 2}}))  # fmt: skip
    t = load_trace(path)
    got = [(e.action.kind, e.start, e.end) for e in stage_events(t)]
    assert got == [("F", 4.0, 5.0), ("B", 6.0, 8.0)]
    assert measured_bubble({1: t})["mean"] == pytest.approx(1 - 3.0 / 10.0)


def test_the_bubble_is_measured_inside_the_schedule_not_the_step(tmp_path):
    """Making the batch, zero_grad and the optimizer step lie outside pipeline:step: not bubble."""
    import json

    from course_utils.pipeline.measure import measured_bubble
    from course_utils.profiling.trace import load_trace

    def ev(name, ts, dur, cat="user_annotation"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    events = [
        ev("ProfilerStep#2", 0, 10_000),
        ev("pipeline:step", 2_000, 6_000),  # 2 ms of data before, 2 ms of optimizer after
        ev("pipeline:F0", 2_000, 2_000),
        ev("pipeline:B0", 5_000, 3_000),
    ]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events,
                                "distributedInfo": {"rank": 0, "world_size": 2}}))  # fmt: skip
    got = measured_bubble({0: load_trace(path)})
    assert got["mean"] == pytest.approx(1 - 5.0 / 6.0)  # 1 ms idle in a 6 ms schedule
    assert got["outside"][0] == pytest.approx(0.4)


@pytest.mark.multiprocess
def test_the_runtime_times_each_stage_inside_the_schedule(runs_root):
    """StageRunner.timings: busy <= span on every stage; with m = 1 on 2 stages each stage idles
    while the other works, about half the schedule; the receive waits are not busy time."""
    res = run_pipeline(pipeline_mlp, "gpipe", p=2, m=1, steps=3, compare=False)
    for out in res.results:
        assert len(out["timings"]) == 3
        for step in out["timings"]:
            assert 0 < step["busy"] <= step["span"]
            assert step["bubble"] == pytest.approx(step["span"] - step["busy"])
    last = [1 - t["busy"] / t["span"] for t in res.results[1]["timings"]]
    assert min(last) > 0.2, last  # stage 1 waits for stage 0's whole forward every step


def test_model_must_be_sequential(runs_root):
    class NotSequential(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="nn.Sequential"):
        run_pipeline(NotSequential, "1f1b", p=2, m=2)
    assert not runs_root.exists() or not any(runs_root.iterdir())


def _every_schedule(ctx, cases, steps):
    """pipeline_worker for each (schedule, m) in turn, in one launch of p ranks."""
    return [pipeline_worker(ctx, pipeline_mlp, s, m, steps=steps) for s, m in cases]


@pytest.mark.multiprocess
@pytest.mark.parametrize("p", [2, 4])
def test_from_scratch_pipeline_equals_one_process(runs_root, p):
    cases = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 4, 8)]
    res = launch(_every_schedule, p, cases=cases, steps=3, echo=False, timeout=180)
    for i, (schedule, m) in enumerate(cases):
        for rank, per_rank in enumerate(res.results):
            out = per_rank[i]
            assert worst(out["diffs"]) < 1e-12, (schedule, p, m, rank, out["diffs"])
        last = res.results[-1][i]
        assert len(last["loss_diffs"]) == 3 and worst(last["loss_diffs"]) < 1e-12, (schedule, m)


@pytest.mark.multiprocess
def test_naive_and_memory_gpipe_vs_1f1b(runs_root):
    assert (
        worst(d for o in run_pipeline(pipeline_mlp, "naive", p=2, m=1).results for d in o["diffs"])
        < 1e-12
    )
    gp = run_pipeline(pipeline_mlp, "gpipe", p=2, m=8, steps=1).results
    fb = run_pipeline(pipeline_mlp, "1f1b", p=2, m=8, steps=1).results
    for stage in range(2):  # activations held at the peak, in micro-batches, as the simulator says
        assert gp[stage]["peak_held_bytes"] == 8 * gp[stage]["micro_bytes"]
        assert fb[stage]["peak_held_bytes"] == (2 - stage) * fb[stage]["micro_bytes"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "schedule, p, m, v",
    [("torch_gpipe", 2, 4, 1), ("torch_1f1b", 2, 4, 1), ("torch_interleaved", 2, 4, 2)],
)
def test_torch_pipelining_equals_one_process(runs_root, schedule, p, m, v):
    why = pipelining_unsupported(schedule.removeprefix("torch_"), "gloo")
    if why:
        with pytest.raises(RuntimeError, match="hangs on gloo"):  # refused at once, no hang
            run_pipeline(pipeline_mlp, schedule, p=p, m=m, v=v, steps=2)
        pytest.skip(why)
    res = run_pipeline(pipeline_mlp, schedule, p=p, m=m, v=v, steps=2)
    assert worst(d for o in res.results for d in o["diffs"]) < 1e-12
    last = res.results[-1]
    assert len(last["loss_diffs"]) == 2 and worst(last["loss_diffs"]) < 1e-12, last["loss_diffs"]
