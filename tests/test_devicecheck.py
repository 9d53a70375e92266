"""The device check: on CPU, fail where a node with one GPU per rank would fail."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils import RankFailedError, launch
from course_utils.launcher.devicecheck import OffDeviceError, check_devices

# make test-floor runs these on the oldest torch too: TorchDispatchMode over c10d ops
pytestmark = [pytest.mark.floor]

DEV = torch.device("cpu")  # what ctx.device is on a CPU rank


def test_tensor_made_without_device_meets_the_device():
    with check_devices(1, DEV), pytest.raises(OffDeviceError) as info:
        buf = torch.empty(4, 3)  # the notebook-05 recv buffer
        buf + torch.ones(4, 3, device=DEV)
    msg = str(info.value)
    assert "rank 1" in msg and "cuda:1" in msg and "a tensor (4, 3)" in msg
    assert "test_tensor_made_without_device_meets_the_device() at line" in msg
    assert "device=ctx.device" in msg


def test_moving_clears_it_and_scalars_are_fine():
    with check_devices(0, DEV):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 3, generator=g).to(DEV)  # made on the CPU, then moved: right
        y = torch.ones(4, 3, device=DEV)
        z = x * y * torch.tensor(2.0)  # a 0-dim CPU tensor beside device tensors is allowed
        w = torch.zeros_like(y) + z  # *_like follows its input
        assert w.shape == (4, 3)


def test_module_never_moved_is_named():
    with check_devices(0, DEV), pytest.raises(OffDeviceError) as info:
        layer = nn.Linear(3, 2)
        layer(torch.ones(4, 3, device=DEV))
    assert "a parameter made without a device" in str(info.value)
    assert "model.to(ctx.device)" in str(info.value)


def test_module_moved_works_and_dtype_alone_is_not_a_move():
    with check_devices(0, DEV):
        nn.Linear(3, 2).to(DEV, torch.float64)(torch.ones(4, 3, device=DEV, dtype=torch.float64))
    with check_devices(0, DEV), pytest.raises(OffDeviceError):
        nn.Linear(3, 2).double()(torch.ones(4, 3, device=DEV, dtype=torch.float64))


def test_cpu_copies_meeting_the_device_again():
    with check_devices(0, DEV):
        y = torch.ones(3, device=DEV)
        assert y.cpu().numpy().tolist() == [1.0, 1.0, 1.0]  # the right way back to numpy
        y + y  # .cpu() above left y where it was
        with pytest.raises(OffDeviceError):
            y + y.detach().cpu()  # a CPU copy meeting the device again
        with pytest.raises(OffDeviceError):
            y + torch.zeros(3, device="cpu")  # a literal "cpu" is the CPU on a GPU node too


def test_move_without_assignment_is_caught():
    """``x.to(device)`` returns a new tensor on a GPU node; x itself stays on the CPU."""
    with check_devices(0, DEV):
        x = torch.randn(3)
        x.to(DEV)  # forgot `x = `
        with pytest.raises(OffDeviceError, match=r"x = x.to\(ctx.device\)"):
            x + torch.ones(3, device=DEV)
        x = x.to(DEV)
        x + torch.ones(3, device=DEV)


def test_correct_idioms_pass():
    with check_devices(0, DEV):
        y = torch.ones(4, 3, device=DEV)
        p = nn.Linear(3, 3).to(DEV).weight
        torch.zeros_like(p, device=DEV) + p  # *_like with the rank's device
        p.new_zeros(3, device=DEV) + y[0]
        labels = torch.as_tensor(y[:, 0], dtype=torch.long)  # as_tensor of a device tensor
        labels + torch.ones(4, dtype=torch.long, device=DEV)
        torch.randn(4, 3).type_as(y) + y  # type_as moves to y's device
        empty = nn.Linear(3, 3, device="meta").to_empty(device=DEV)
        empty(y)


def test_tags_stay_out_of_pickles():
    import pickle

    with check_devices(0, DEV):
        x = torch.randn(3)  # tagged: made without a device
        blob = pickle.dumps(x)
    assert "_course" not in str(blob) and torch.equal(pickle.loads(blob), x)


def test_everything_is_restored_afterwards():
    from torch.nn.parallel import DistributedDataParallel as DDP

    before = (nn.Parameter.__dict__["__new__"], dist.all_reduce, dist.send, DDP.__init__)
    with check_devices(0, DEV):
        assert dist.all_reduce is not before[1]
    after = (nn.Parameter.__dict__["__new__"], dist.all_reduce, dist.send, DDP.__init__)
    assert after == before
    torch.empty(3) + torch.ones(3)  # no mode left behind


def collective_on_cpu_tensor(ctx, with_device):
    t = torch.ones(3, device=ctx.device) if with_device else torch.ones(3)
    dist.all_reduce(t)
    return t.tolist()


@pytest.mark.multiprocess
def test_collective_given_a_cpu_tensor_fails_under_launch(runs_root):
    with pytest.raises(RankFailedError) as info:
        launch(collective_on_cpu_tensor, 2, with_device=False, check_devices=True, echo=False)
    msg = str(info.value)
    assert "dist.all_reduce was given a tensor (3,) made without a device" in msg
    assert "collective_on_cpu_tensor() at line" in msg
    ok = launch(collective_on_cpu_tensor, 2, with_device=True, check_devices=True, echo=False)
    assert ok.results == [[2.0] * 3] * 2
    unchecked = launch(collective_on_cpu_tensor, 2, with_device=False, check_devices=False)
    assert unchecked.results == [[2.0] * 3] * 2  # the bug is invisible on CPU without the check


def pipeline_recv_without_device(ctx):
    """Notebook 05's stage before the fix: a receive buffer made without device=."""
    stage = nn.Linear(4, 4).to(ctx.device)
    if ctx.rank == 0:
        dist.send(stage(torch.ones(2, 4, device=ctx.device)).detach(), dst=1)
    else:
        x = torch.empty(2, 4)
        dist.recv(x, src=0)
        stage(x)


@pytest.mark.multiprocess
def test_notebook_05_recv_buffer_bug_is_found(runs_root):
    with pytest.raises(RankFailedError) as info:
        launch(pipeline_recv_without_device, 2, check_devices=True, echo=False, timeout=90)
    assert info.value.rank == 1
    assert "dist.recv was given a tensor (2, 4) made without a device" in str(info.value)


def ddp_of_unmoved_module(ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP(nn.Linear(4, 4))


def stage_given_by_keyword(ctx):
    from torch.distributed.pipelining import PipelineStage

    stage = PipelineStage(
        submodule=nn.Linear(4, 4).to(ctx.device), stage_index=0, num_stages=1, device=ctx.device
    )
    return type(stage).__name__


@pytest.mark.multiprocess
def test_pipeline_stage_by_keyword_passes_the_guard(runs_root):
    assert launch(stage_given_by_keyword, 1, check_devices=True, echo=False).results == [
        "PipelineStage"
    ]


@pytest.mark.multiprocess
def test_ddp_of_a_module_never_moved_is_found(runs_root):
    with pytest.raises(RankFailedError) as info:
        launch(ddp_of_unmoved_module, 2, check_devices=True, echo=False)
    assert "DistributedDataParallel was given a module whose parameter 'weight'" in str(info.value)
