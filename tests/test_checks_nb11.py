"""Notebook 11's exercise checks (11.1 sharded save and load, 11.2 resume, 11.3 the interval of
best goodput): each passes a right answer, refuses the package's code (the sharded checkpoint,
DCP, resume, interval) and names the typical mistakes."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_utils import checks
from course_utils.checkpoint import ShardedState, interval, load, resume, save
from course_utils.checkpoint import dcp as course_dcp
from tests.checks_support import fails

pytestmark = [pytest.mark.multiprocess]


# ---- 11.1 -------------------------------------------------------------------------------------


def save_sharded(pieces, folder, rank, world_size):
    folder = Path(folder)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [(s.name, s.offsets, s.lengths) for s, _ in pieces])
    first = {}
    for r, descs in enumerate(everyone):
        for d in descs:
            first.setdefault(d, r)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    own = {f"{s.name}{list(s.offsets)}": t.detach().cpu().clone() for s, t in pieces
           if first[(s.name, s.offsets, s.lengths)] == rank}  # fmt: skip
    torch.save(own, folder / f"shard{rank}.pt")
    dist.barrier()
    if rank == 0:
        index = [[d[0], list(d[1]), list(d[2]), r] for d, r in first.items()]
        (folder / "index.json").write_text(json.dumps(index))
    dist.barrier()


def load_sharded(folder, want, rank):
    folder = Path(folder)
    for s, t in want:
        for name, offsets, lengths, r in json.loads((folder / "index.json").read_text()):
            if name != s.name:
                continue
            lo = [max(a, b) for a, b in zip(offsets, s.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, lengths, s.offsets, s.lengths)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            src = torch.load(folder / f"shard{r}.pt")[f"{name}{offsets}"]
            t[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s.offsets))] = src[
                tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            ]


def test_11_1_passes_and_refuses_the_package(runs_root, capsys):
    checks.check_sharded_checkpoint(save_sharded, load_sharded)
    assert "✓ exercise 11.1" in capsys.readouterr().out

    def package_save(pieces, folder, rank, world_size):
        save(ShardedState(pieces), folder, rank=rank, world_size=world_size)

    def package_load(folder, want, rank):
        load(folder, want, rank=rank)

    def check_save(fn):
        return checks.check_sharded_checkpoint(fn, load_sharded)

    def check_load(fn):
        return checks.check_sharded_checkpoint(save_sharded, fn)

    fails(check_save, package_save, "package's sharded checkpoint")
    fails(check_load, package_load, "package's sharded checkpoint")

    def dcp_save(pieces, folder, rank, world_size):  # DCP on the pieces' tensors: refused too
        import torch.distributed.checkpoint as tdcp

        tdcp.save({s.name: t for s, t in pieces}, checkpoint_id=str(folder))

    fails(check_save, dcp_save, "torch's DCP")


def test_11_1_a_load_that_communicates(runs_root):
    def load_with_barrier(folder, want, rank):
        dist.barrier()
        load_sharded(folder, want, rank)

    fails(lambda fn: checks.check_sharded_checkpoint(save_sharded, fn), load_with_barrier,
          "needed a process group")  # fmt: skip


# ---- 11.2 -------------------------------------------------------------------------------------


def snapshot_state(step, position, device):
    return {"step": step, "data": asdict(position)}, {"rng": torch.get_rng_state()}


def restore_state(meta, per_rank, device):
    torch.set_rng_state(per_rank["rng"])
    return meta["step"], resume.DataPosition(**meta["data"])


def test_11_2_passes_and_refuses_the_package(runs_root, capsys):
    checks.check_resume(snapshot_state, restore_state)
    assert "✓ exercise 11.2" in capsys.readouterr().out

    def package_restore(meta, per_rank, device):
        return resume.restore(resume.Loaded(meta, per_rank, 2), device, 2)

    fails(lambda fn: checks.check_resume(resume.capture, restore_state), None,
          "package's resume helper")  # fmt: skip
    fails(lambda fn: checks.check_resume(snapshot_state, fn), package_restore,
          "package's resume helper")  # fmt: skip

    def draws(step, position, device):
        torch.rand(1)  # a snapshot that moves the generator it should record
        return snapshot_state(step, position, device)

    fails(lambda fn: checks.check_resume(fn, restore_state), draws, "draw nothing")


# ---- 11.3 -------------------------------------------------------------------------------------


def checkpoint_interval(cost, restart, gpus, record):
    m = record.days * 86400 / record.unexpected * record.gpus / gpus
    lo, hi = 1e-6 * m, m  # ternary search: goodput has one maximum in (0, M)
    for _ in range(200):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if interval.goodput(a, cost, restart, m) < interval.goodput(b, cost, restart, m):
            lo = a
        else:
            hi = b
    return (lo + hi) / 2


def young(cost, restart, gpus, record):
    return math.sqrt(2 * cost * record.days * 86400 / record.unexpected * record.gpus / gpus)


def test_11_3(capsys):
    checks.check_interval(checkpoint_interval)
    assert "✓ exercise 11.3" in capsys.readouterr().out

    def package(cost, restart, gpus, record):
        return interval.best_interval(cost, restart, record.job_mtbf(gpus))

    fails(checks.check_interval, package, "package's interval")

    def daly(cost, restart, gpus, record):
        return interval.daly_interval(cost, record.days * 86400 / record.unexpected)

    fails(checks.check_interval, daly, "package's interval")

    def off(cost, restart, gpus, record):  # a slip no hint names
        return 1.05 * checkpoint_interval(cost, restart, gpus, record)

    message = fails(checks.check_interval, off, "your τ is too long")
    want = interval.best_interval(5.0, 300.0, interval.LLAMA3.job_mtbf(1024))
    assert f"{want:.0f}" not in message  # the expected answer is not given


def test_11_3_young_passes_only_where_saves_are_cheap():
    from course_utils.checks import nb11

    cost, restart, gpus, rec = nb11.INTERVAL_CASES[-1]
    m = rec.job_mtbf(gpus)
    assert cost / m > 0.2  # a costly save: Young's τ is 25 % too long, its goodput 0.6 % lower
    best = interval.best_interval(cost, restart, m)
    assert young(*nb11.INTERVAL_CASES[-1]) / best > 1.2
    # the first case (C/M = 3e-5) passes Young's answer; the second names it
    message = fails(checks.check_interval, young, "first-order formula misses the optimum")
    assert "C = 60 s" in message

    def first_order_search(cost, restart, gpus, record):  # the wrong objective, searched
        m = record.days * 86400 / record.unexpected * record.gpus / gpus
        taus = [m * 10 ** (k / 2000 - 4) for k in range(8001)]
        return min(taus, key=lambda t: interval.waste_first_order(t, cost, restart, m))

    fails(checks.check_interval, first_order_search, "Young's sqrt(2·C·M)")

    def hours(cost, restart, gpus, record):
        return checkpoint_interval(cost, restart, gpus, record) / 3600

    fails(checks.check_interval, hours, "interval must be in seconds")

    def goodput_calls_allowed(cost, restart, gpus, record):  # goodput is the model, not refused
        tau = checkpoint_interval(cost, restart, gpus, record)
        assert interval.goodput(tau, cost, restart, record.days * 86400 / record.unexpected) > 0
        return tau

    checks.check_interval(goodput_calls_allowed)


def test_best_interval_maximizes_goodput():
    """interval.best_interval, the check's reference (beside interval.py's hand calculation)."""
    m = interval.LLAMA3.job_mtbf()
    for cost in (1.0, 60.0, 1800.0, 0.2 * m, m):
        best = interval.best_interval(cost, 600, m)
        # the optimality condition: 1 - e^(-(τ+C)/M) = τ/M
        assert -math.expm1(-(best + cost) / m) == pytest.approx(best / m, rel=1e-12)
        g = interval.goodput(best, cost, 600, m)
        assert g >= max(interval.goodput(best * f, cost, 600, m) for f in (0.999, 1.001))
        assert best < interval.young_interval(cost, m)  # the optimum lies below Young's
        assert interval.best_interval(cost, 0, m) == best  # R does not move it
    # C = 60 s: Daly's expansion and the exact root agree to 0.01 s; Young's is 3.6 % too long
    assert interval.best_interval(60, 600, m) == pytest.approx(1116.296, abs=1e-3)
    assert interval.daly_interval(60, m) == pytest.approx(1116.296, abs=0.01)
    assert interval.goodput(1e9, 60, 600, m) == 0.0  # past a float's e^x: no useful work


def test_course_dcp_refused_in_11_1_check():
    """The package's DCP wrappers are among the refused functions (checked without launching)."""
    from course_utils.checks import nb11

    assert course_dcp.save in nb11._dcp_functions()
