"""Notebook 11's exercise checks (11.1 sharded save and load, 11.2 resume, 11.3 Young's interval):
each passes a right answer, refuses the package's code (the sharded checkpoint, DCP, resume,
interval) and names the typical mistakes."""

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


def checkpoint_interval(cost, gpus, record):
    return math.sqrt(2 * cost * record.days * 86400 / record.unexpected * record.gpus / gpus)


def test_11_3(capsys):
    checks.check_interval(checkpoint_interval)
    assert "✓ exercise 11.3" in capsys.readouterr().out

    def package(cost, gpus, record):
        return interval.young_interval(cost, record.job_mtbf(gpus))

    fails(checks.check_interval, package, "package's interval")

    def daly(cost, gpus, record):
        return interval.daly_interval(cost, record.days * 86400 / record.unexpected)

    fails(checks.check_interval, daly, "package's interval")

    def off(cost, gpus, record):  # a slip no hint names: the factor and the formula are given
        return 1.5 * checkpoint_interval(cost, gpus, record)

    message = fails(checks.check_interval, off, "off by a factor 1.5")
    want = interval.young_interval(60.0, interval.LLAMA3.job_mtbf())
    assert f"{want:.0f}" not in message  # the expected answer is not given


def test_course_dcp_refused_in_11_1_check():
    """The package's DCP wrappers are among the refused functions (checked without launching)."""
    from course_utils.checks import nb11

    assert course_dcp.save in nb11._dcp_functions()
