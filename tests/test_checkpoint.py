"""Checkpoints (notebook 11): sharded save/load, resharding across layouts, exact resume, crash
safety, DCP and its async save, the interval formulas and the bytes per rank.

Real gloo ranks, float64, a ToyMLP of 1,732 parameters with Adam. The reference for every load is
the state the saving ranks held, rebuilt whole by collectives that do not use the checkpoint code
(all-gathers of the shards, ``full_tensor()``), and compared exactly (``torch.equal``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from course_utils import launch
from course_utils.checkpoint import (
    ShardedState,
    contents,
    interval,
    latest,
    layouts,
    load,
    read_index,
    resume,
    save,
    sharded,
)
from course_utils.compat import fsdp2_unsupported
from course_utils.models import ToyMLP
from course_utils.parity import global_batches
from course_utils.zero import ShardedOptimizer

pytestmark = pytest.mark.multiprocess
D = torch.float64
PSI = 1732  # ToyMLP(16, 32, 4): 16·32+32 + 32·32+32 + 32·4+4
B = 3 * 8  # bytes per parameter in a checkpoint: the parameter and Adam's two moments, float64


# --- helpers run inside the ranks ------------------------------------------------------------
def fresh(seed: int = 0, device="cpu") -> nn.Module:
    torch.manual_seed(seed)
    return ToyMLP().to(device, D)


def train(call, opt, steps: int, n: int, r: int, device) -> None:
    """``steps`` Adam steps, this rank on its part of the same global batches everywhere."""
    for x, y in global_batches(steps, 8, 16, 4, D, device, seed=1):
        opt.zero_grad()
        F.cross_entropy(call(x.chunk(n)[r]), y.chunk(n)[r]).backward()
        opt.step()


def full_plain(model: nn.Module, opt) -> dict:
    """Every parameter and Adam state of a replicated model, by checkpoint name."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out |= {f"{n}.{k}": v.clone() for k, v in opt.state[p].items()}
    return out


def full_zero(model: nn.Module, opt: ShardedOptimizer) -> dict:
    """A ZeRO-1 state whole: parameters (replicated) and the flat Adam shards all-gathered."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for b, s in zip(opt.buckets[0], opt.shards[0]):
        for key, v in opt.optim.state[s].items():
            if v.dim() == 0:
                out |= {f"{names[id(p)]}.{key}": v.clone() for p in b.params}
                continue
            flat = torch.empty(b.padded, dtype=v.dtype, device=v.device)
            dist.all_gather_into_tensor(flat, v.contiguous())
            out |= {f"{names[id(p)]}.{key}": t.clone() for p, t in zip(b.params, b.views(flat))}
    return out


def full_fsdp2(model: nn.Module, opt) -> dict:
    whole = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            whole[f"{n}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return whole


def zero_model(ctx, seed: int):
    model = fresh(seed, ctx.device)
    return model, ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)


def fsdp2_model(ctx, seed: int):
    from torch.distributed.fsdp import fully_shard

    from course_utils.zero.run import cpu_or_device_mesh

    model = fresh(seed, ctx.device)
    mesh = cpu_or_device_mesh(ctx.device)
    for m in (model.fc1, model.fc2, model.fc3, model):
        fully_shard(m, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


# --- workers ---------------------------------------------------------------------------------
def ddp_save(ctx, folder):
    model = fresh(0, ctx.device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    train(ddp, opt, 2, ctx.world_size, ctx.rank, ctx.device)
    save(ShardedState(layouts.replicated(ddp, opt), meta={"step": 2}), folder,
         rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
    return full_plain(model, opt)


def zero_save_and_load(ctx, folder, ddp_folder):
    """ZeRO-1 on 4 ranks: save, load under the same layout, and load the DDP checkpoint."""
    model, opt = zero_model(ctx, 0)
    train(model, opt, 2, ctx.world_size, ctx.rank, ctx.device)
    save(ShardedState(layouts.zero(model, opt, ctx.rank)), folder,
         rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
    saved = full_zero(model, opt)
    out = {"saved": saved}
    for name, source in (("same", folder), ("from_ddp", ddp_folder)):
        again, opt2 = zero_model(ctx, 7)
        layouts.init_optimizer_state(opt2)
        load(source, layouts.zero(again, opt2, ctx.rank), rank=ctx.rank)
        layouts.zero_after_load(again, opt2)
        out[name] = full_zero(again, opt2)
    return out


def zero_load(ctx, folder):
    model, opt = zero_model(ctx, 7)
    layouts.init_optimizer_state(opt)
    load(folder, layouts.zero(model, opt, ctx.rank), rank=ctx.rank)
    layouts.zero_after_load(model, opt)
    return full_zero(model, opt)


def tp_model(ctx, seed: int):
    from course_utils.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    model = fresh(seed, ctx.device)
    model.fc1 = ColumnParallelLinear.from_linear(model.fc1)
    model.fc2 = RowParallelLinear.from_linear(model.fc2)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full_tp(model: nn.Module, opt, n: int) -> dict:
    """A Megatron-sharded state whole: fc1's rows and fc2's columns all-gathered."""
    cut = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    out = {}
    for name, v in full_plain(model, opt).items():
        d = cut.get(name.rsplit(".", 1)[0] if name.count(".") == 2 else name)
        if d is None or v.dim() == 0:
            out[name] = v
            continue
        parts = [torch.empty_like(v) for _ in range(n)]
        dist.all_gather(parts, v.contiguous())
        out[name] = torch.cat(parts, d)
    return out


def tp_save(ctx, folder):
    model, opt = tp_model(ctx, 0)
    train(model, opt, 2, 1, 0, ctx.device)  # TP: every rank sees the whole batch
    save(ShardedState(layouts.tensor_parallel(model, opt, ctx.rank, ctx.world_size)), folder,
         rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
    return full_tp(model, opt, ctx.world_size)


def layout(kind: str, ctx, seed: int):
    """``kind``'s model and optimizer, and three callables: this rank's (Slice, tensor) pairs,
    what follows a load, and the whole state rebuilt by collectives (not by the checkpoint)."""
    n, r = ctx.world_size, ctx.rank
    if kind == "ddp":
        model = fresh(seed, ctx.device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return (
            model,
            opt,
            lambda: layouts.replicated(model, opt),
            None,
            lambda: full_plain(model, opt),
        )
    if kind == "zero1":
        model, opt = zero_model(ctx, seed)
        after = lambda: layouts.zero_after_load(model, opt)  # noqa: E731
        return model, opt, lambda: layouts.zero(model, opt, r), after, lambda: full_zero(model, opt)
    if kind == "fsdp2":
        model, opt = fsdp2_model(ctx, seed)
        return model, opt, lambda: layouts.fsdp2(model, opt), None, lambda: full_fsdp2(model, opt)
    model, opt = tp_model(ctx, seed)
    pairs = lambda: layouts.tensor_parallel(model, opt, r, n)  # noqa: E731
    return model, opt, pairs, None, lambda: full_tp(model, opt, n)


def every_pair(ctx, root, kinds):
    """Each layout trains and saves; every layout loads every checkpoint; names the pairs whose
    loaded state differs from what was saved."""
    n, r = ctx.world_size, ctx.rank
    saved = {}
    for kind in kinds:
        model, opt, pairs, _, whole = layout(kind, ctx, 0)
        call = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
        train(call, opt, 2, *((1, 0) if kind == "tp" else (n, r)), ctx.device)
        save(ShardedState(pairs()), Path(root) / kind, rank=r, world_size=n)
        saved[kind] = whole()
    wrong = []
    for src in kinds:
        for dst in kinds:
            _, opt, pairs, after, whole = layout(dst, ctx, 7)
            layouts.init_optimizer_state(opt)
            load(Path(root) / src, pairs(), rank=r)
            if after:
                after()
            got = whole()
            if sorted(got) != sorted(saved[src]) or any(
                not torch.equal(got[k].double(), saved[src][k].double()) for k in got
            ):
                wrong.append(f"{src} -> {dst}")
    return wrong


def fsdp2_save(ctx, folder):
    model, opt = fsdp2_model(ctx, 0)
    train(model, opt, 2, ctx.world_size, ctx.rank, ctx.device)
    save(ShardedState(layouts.fsdp2(model, opt)), folder, rank=ctx.rank, world_size=ctx.world_size)
    return full_fsdp2(model, opt)


def fsdp2_load(ctx, folder):
    model, opt = fsdp2_model(ctx, 7)
    layouts.init_optimizer_state(opt)
    load(folder, layouts.fsdp2(model, opt), rank=ctx.rank)
    return full_fsdp2(model, opt)


# --- tests -----------------------------------------------------------------------------------
def equal_states(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not torch.equal(a[k].double(), b[k].double())]
    assert not bad, f"differ: {bad}"


def shard_sizes(folder: Path, n: int) -> list[int]:
    return [(folder / f"shard-{r}.pt").stat().st_size if (folder / f"shard-{r}.pt").exists()
            else 0 for r in range(n)]  # fmt: skip


def tensors_in(folder: Path, r: int) -> int:
    index = read_index(folder)
    return sum(s["rank"] == r for e in index["tensors"].values() for s in e["slices"])


def within_overhead(folder: Path, formula: list[int]) -> None:
    """Files hold the formula's bytes plus torch.save's zip headers and pickle, and Adam's 0-d
    step counts: at most 512 bytes per tensor and 1 KiB per file (measured: see the report)."""
    for r, (size, want) in enumerate(zip(shard_sizes(folder, len(formula)), formula)):
        k = tensors_in(folder, r)
        assert want <= size <= want + 512 * k + (1024 if k else 0), (r, size, want, k)


def test_zero_and_ddp_resharding(tmp_path, runs_root):
    """Same layout; ZeRO 4 ranks -> 2; DDP (2 ranks) -> ZeRO on 4; bytes per rank by formula."""
    ddp, z4 = tmp_path / "ddp", tmp_path / "zero4"
    ddp_state = launch(ddp_save, 2, folder=str(ddp)).results[0]
    assert shard_sizes(ddp, 2)[1] == 0  # replicated: rank 0 alone writes
    res = launch(zero_save_and_load, 4, folder=str(z4), ddp_folder=str(ddp)).results
    saved = res[0]["saved"]
    for r in range(4):
        equal_states(res[r]["same"], saved)
        equal_states(res[r]["from_ddp"], ddp_state)
    for state in launch(zero_load, 2, folder=str(z4)).results:
        equal_states(state, saved)
    within_overhead(ddp, contents.replicated_bytes(PSI, 2, B))
    within_overhead(z4, contents.flat_bytes(PSI, 4, B))


def test_tensor_parallel_to_whole(tmp_path, runs_root):
    """Saved as Megatron column/row shards on 2 ranks, loaded whole by one process."""
    folder = tmp_path / "tp"
    saved = launch(tp_save, 2, folder=str(folder)).results[0]
    model = fresh(7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    layouts.init_optimizer_state(opt)
    load(folder, layouts.replicated(model, opt), rank=0)
    equal_states(full_plain(model, opt), saved)
    index = read_index(folder)
    assert [s["rank"] for s in index["tensors"]["fc1.weight"]["slices"]] == [0, 1]
    assert [s["rank"] for s in index["tensors"]["fc2.bias"]["slices"]] == [0]  # written once
    cut = [((32, 16), 0), ((32,), 0), ((32, 32), 1)]
    whole = [(32,), (4, 32), (4,)]
    within_overhead(folder, contents.tensor_parallel_bytes(cut, whole, 2, B))


@pytest.mark.skipif(fsdp2_unsupported("cpu") is not None, reason=str(fsdp2_unsupported("cpu")))
def test_fsdp2_four_ranks_to_two(tmp_path, runs_root):
    folder = tmp_path / "fsdp2"
    saved = launch(fsdp2_save, 4, folder=str(folder)).results[0]
    for state in launch(fsdp2_load, 2, folder=str(folder)).results:
        equal_states(state, saved)
    shapes = [(32, 16), (32,), (32, 32), (32,), (4, 32), (4,)]
    within_overhead(folder, contents.chunked_bytes(shapes, 4, B))


def test_every_layout_loads_every_other(tmp_path, runs_root):
    """DDP, ZeRO-1, FSDP2 and TP on 2 ranks: each saves after 2 steps, and each loads each
    checkpoint (16 pairs) to exactly the saved state. Pipeline stages: test_pipeline_stages_to_whole."""
    kinds = ["ddp", "zero1", "tp"] + ([] if fsdp2_unsupported("cpu") else ["fsdp2"])
    for wrong in launch(every_pair, 2, root=str(tmp_path), kinds=kinds).results:
        assert wrong == [], f"loaded state differs from the saved one: {wrong}"


def stage_save(ctx, folder):
    """Two pipeline stages of one Sequential: rank r keeps its layers, steps them, saves them."""
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)).to(ctx.device, D)  # fmt: skip
    first = (0, 2)[ctx.rank]
    stage = nn.Sequential(*list(full)[first : (2, 5)[ctx.rank]])  # as pipeline/parity.py cuts
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    for p in stage.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    save(ShardedState(layouts.pipeline_stage(stage, opt, first)), folder,
         rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
    return {f"{int(k.split('.')[0]) + first}.{k.split('.', 1)[1]}": v
            for k, v in full_plain(stage, opt).items()}  # fmt: skip


def test_pipeline_stages_to_whole(tmp_path, runs_root):
    folder = tmp_path / "pp"
    res = launch(stage_save, 2, folder=str(folder)).results
    torch.manual_seed(3)
    full = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)).to(D)  # fmt: skip
    opt = torch.optim.Adam(full.parameters(), lr=1e-2)
    layouts.init_optimizer_state(opt)
    load(folder, layouts.replicated(full, opt), rank=0)
    equal_states(full_plain(full, opt), res[0] | res[1])
    within_overhead(folder, contents.pipeline_bytes([16 * 32 + 32, 32 * 32 + 32 + 32 * 4 + 4], B))


# --- resume bit for bit ----------------------------------------------------------------------
SAMPLES, PER_RANK = 64, 4


def dropout_net(seed: int, device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)).to(
        device, D
    )


def resume_run(ctx, root, steps, save_at=None, restart=False):
    """ZeRO-1 training with dropout and noisy data drawn from each rank's own generator, over a
    DistributedSampler that reshuffles each epoch; saves after step ``save_at``, or starts from
    the latest checkpoint (``restart``)."""
    n, r = ctx.world_size, ctx.rank
    model = dropout_net(9 if restart else 0, ctx.device)
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    data = torch.Generator().manual_seed(5)
    xs = torch.randn(SAMPLES, 16, generator=data, dtype=D).to(ctx.device)
    ys = torch.randint(4, (SAMPLES,), generator=data).to(ctx.device)
    torch.manual_seed(100 + r)  # every rank draws its own dropout masks and noise
    step, pos = 0, resume.DataPosition(seed=3)
    if restart:
        layouts.init_optimizer_state(opt)
        loaded = load(latest(root), layouts.zero(model, opt, r), rank=r)
        layouts.zero_after_load(model, opt)
        step, pos = resume.restore(loaded, ctx.device, n)
    losses = {}
    while step < steps:
        idx = pos.batch(SAMPLES, PER_RANK, r, n)
        x = xs[idx] + 0.1 * torch.randn(len(idx), 16, dtype=D, device=ctx.device)  # (4, 16)
        loss = F.cross_entropy(model(x), ys[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        pos.advance(SAMPLES // (PER_RANK * n))
        losses[step] = loss.item()
        if step == save_at:
            meta, mine = resume.capture(step, pos, ctx.device)
            save(ShardedState(layouts.zero(model, opt, r), meta, mine),
                 Path(root) / f"step-{step:08d}", rank=r, world_size=n)  # fmt: skip
    return {
        "losses": losses,
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
    }


def test_resume_equals_uninterrupted_run(tmp_path, runs_root):
    """12 steps (an epoch is 8) saved after step 5 and resumed in a new launch: the same losses
    on every rank and the same parameters, bit for bit."""
    root = tmp_path / "ckpts"
    whole = launch(resume_run, 2, root=str(root), steps=12, save_at=5).results
    again = launch(resume_run, 2, root=str(root), steps=12, restart=True).results
    for r in range(2):
        assert sorted(again[r]["losses"]) == list(range(6, 13))
        assert all(again[r]["losses"][s] == whole[r]["losses"][s] for s in range(6, 13))
        equal_states(again[r]["params"], whole[r]["params"])
    assert whole[0]["losses"][6] != whole[1]["losses"][6]  # the ranks really differ


# --- a crash in the middle of a save ---------------------------------------------------------
def crash_during_save(ctx, root):
    import time

    n, r = ctx.world_size, ctx.rank
    w = torch.arange(12, dtype=D, device=ctx.device).reshape(4, 3)

    def state(step: int) -> ShardedState:
        s = layouts.chunk_slice("w", (4, 3), 0, r, n)
        return ShardedState([(s, (w * step).chunk(n)[r])], meta={"step": step})

    save(state(1), Path(root) / "step-00000001", rank=r, world_size=n)
    if r == 1:  # dies once rank 0 has started writing its file
        partial = Path(root) / "step-00000002.partial"

        def die(obj, path):
            while not (partial / "shard-0.pt").exists():
                time.sleep(0.01)
            raise RuntimeError("rank 1 died while saving")

        sharded._fsync_save = die
    save(state(2), Path(root) / "step-00000002", rank=r, world_size=n)


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, runs_root):
    from course_utils.launcher.errors import LaunchError

    root = tmp_path / "ckpts"
    with pytest.raises(LaunchError, match="rank 1 died while saving"):
        launch(crash_during_save, 2, root=str(root))
    assert latest(root) == root / "step-00000001"
    assert not (root / "step-00000002").exists()
    assert (root / "step-00000002.partial" / "shard-0.pt").exists()  # rank 0 had written
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        read_index(root / "step-00000002.partial")
    w = torch.zeros(4, 3, dtype=D)
    loaded = load(latest(root), [layouts.whole("w", w)], rank=0)
    assert torch.equal(w, torch.arange(12, dtype=D).reshape(4, 3)) and loaded.meta == {"step": 1}


def test_index_reaches_the_disk_before_the_rename(tmp_path, monkeypatch):
    # a power loss after the rename must not find the committed folder's index empty
    events = []
    fsync = sharded.os.fsync

    def record_fsync(fd):
        events.append(("fsync", Path(sharded.os.readlink(f"/proc/self/fd/{fd}")).name))
        fsync(fd)

    commit = sharded._commit
    monkeypatch.setattr(sharded.os, "fsync", record_fsync)
    monkeypatch.setattr(sharded, "_commit", lambda *a: (events.append(("commit",)), commit(*a)))
    w = torch.arange(6, dtype=D)
    save(ShardedState([layouts.whole("w", w)]), tmp_path / "step-1", rank=0, world_size=1)
    assert ("fsync", "index.json") in events
    assert events.index(("fsync", "index.json")) < events.index(("commit",))
    assert read_index(tmp_path / "step-1")["files"]


# --- DCP -------------------------------------------------------------------------------------
def dcp_save_async_and_load(ctx, root):
    from course_utils.checkpoint import dcp

    model = fresh(0, ctx.device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    train(ddp, opt, 2, ctx.world_size, ctx.rank, ctx.device)
    snapshot = full_plain(model, opt)
    dcp.save(ddp, opt, Path(root) / "sync", extra={"step": 2})
    future = dcp.async_save(ddp, opt, Path(root) / "async", process_group=dcp.checkpoint_group(),
                            extra={"step": 2})  # fmt: skip
    train(ddp, opt, 1, ctx.world_size, ctx.rank, ctx.device)  # training goes on meanwhile
    future.result()
    out = {"snapshot": snapshot}
    for name in ("sync", "async"):
        again = fresh(7, ctx.device)
        opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
        out[f"{name}_extra"] = dcp.load(again, opt2, Path(root) / name, extra={"step": 0})
        out[name] = full_plain(again, opt2)
    return out


def dcp_into_fsdp2(ctx, folder):
    from course_utils.checkpoint import dcp

    model, opt = fsdp2_model(ctx, 7)
    dcp.load(model, opt, folder)
    return full_fsdp2(model, opt)


@pytest.mark.floor  # torch 2.6's async_save did not copy CPU tensors (dcp.async_save copies)
def test_dcp_sync_async_and_resharding(tmp_path, runs_root):
    """DCP: sync and async saves of DDP training equal the state at the save (the async one even
    though training changed the parameters meanwhile); replicated tensors are written once; the
    DDP checkpoint loads into FSDP2 shards on 4 ranks."""
    res = launch(dcp_save_async_and_load, 2, root=str(tmp_path)).results
    for r in range(2):
        for name in ("sync", "async"):
            equal_states(res[r][name], res[r]["snapshot"])
            assert res[r][f"{name}_extra"] == {"step": 2}
    from torch.distributed.checkpoint import FileSystemReader

    # deduplicated: every replicated entry in exactly one rank's file (balanced over both ranks)
    meta = FileSystemReader(str(tmp_path / "sync")).read_metadata()
    files: dict[str, list[str]] = {}
    for index, info in meta.storage_data.items():
        files.setdefault(info.relative_path, []).append(index.fqn)
    names = [fqn for fqns in files.values() for fqn in fqns]
    assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"]
    assert len(names) == len(set(names)) == len(meta.state_dict_metadata)
    if fsdp2_unsupported("cpu"):
        pytest.skip(fsdp2_unsupported("cpu"))
    for state in launch(dcp_into_fsdp2, 4, folder=str(tmp_path / "sync")).results:
        equal_states(state, res[0]["snapshot"])


# --- formulas --------------------------------------------------------------------------------
def test_interval_against_a_hand_calculation():
    # Llama 3: 54 days = 4,665,600 s over 419 unexpected interruptions = 11,135.08 s (3.09 h)
    m = interval.LLAMA3.job_mtbf()
    assert m == pytest.approx(11135.08, abs=0.01)
    assert interval.LLAMA3.job_mtbf(gpus=1024) == pytest.approx(16 * 11135.08, abs=0.2)
    # C = 60 s: sqrt(2 · 60 · 11,135.08) = sqrt(1,336,210) = 1,155.94 s
    tau = interval.young_interval(60, m)
    assert tau == pytest.approx(1155.94, abs=0.01)
    # Daly: x = 60 / 22,270.17 = 0.0026942; 1155.94 · (1 + 0.051906/3 + 0.0026942/9) - 60
    assert interval.daly_interval(60, m) == pytest.approx(1155.94 * 1.0176011 - 60, abs=0.01)
    assert interval.daly_interval(3 * m, m) == m
    # first order: 60/1155.94 + 1155.94/22,270.17 + 600/11,135.08 = 0.05191 + 0.05191 + 0.05388
    assert interval.waste_first_order(tau, 60, 600, m) == pytest.approx(0.15769, abs=1e-5)
    g = interval.goodput(tau, 60, 600, m)
    # Daly: 1155.94 / (11,135.08 · e^(600/11,135.08) · (e^(1215.94/11,135.08) - 1))
    #      = 1155.94 / (11,135.08 · 1.055362 · 0.115384) = 1155.94 / 1355.94 = 0.8525
    assert g == pytest.approx(0.8525, abs=1e-4)
    assert g > max(interval.goodput(tau / 2, 60, 600, m), interval.goodput(tau * 2, 60, 600, m))
    assert interval.goodput(interval.daly_interval(60, m), 60, 600, m) >= g
    assert interval.expected_lost_work(tau, 60, 600) == pytest.approx(600 + 1215.94 / 2, abs=0.01)


def test_contents_formulas():
    assert contents.bytes_per_parameter(8, 2, 8) == B
    assert contents.bytes_per_parameter(2, 2, 4, master_bytes=4) == 14  # bf16 + fp32 master, Adam
    assert contents.flat_bytes(10, 4, 1) == [3, 3, 3, 1]
    assert sum(contents.flat_bytes(PSI, 4, B)) == PSI * B
    assert contents.chunked_bytes([(5, 2)], 4, 1) == [4, 4, 2, 0]  # torch.chunk: 2, 2, 1, none
    assert contents.layout_bytes("ddp", 8e9, 64, 16) == 16 * 8e9
    assert contents.layout_bytes("zero3", 8e9, 64, 16) == 16 * 8e9 / 64
    assert contents.layout_bytes("ddp", 8e9, 64, 16, balanced=True) == 16 * 8e9 / 64
    assert contents.layout_bytes("tp", 8e9, 64, 16, tp=8) == 16 * 8e9 / 8  # 8 replicas: one writes
    assert contents.layout_bytes("tp", 8e9, 64, 16, tp=8, balanced=True) == 16 * 8e9 / 64
    with pytest.raises(ValueError, match="divide"):
        contents.layout_bytes("tp", 8e9, 64, 16, tp=6)
