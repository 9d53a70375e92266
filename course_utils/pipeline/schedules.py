"""Running a pipeline schedule for real: one stage per rank, micro-batches through P2P.

Each rank executes *the simulator's own* action list for its stage
(:func:`.simulate.schedule_order`). The measured timeline and the theory therefore describe the same
schedule:

- ``naive``: the whole batch as one micro-batch (``m = 1``): model parallelism with no overlap;
- ``gpipe``: all ``m`` forwards, then all ``m`` backwards;
- ``1f1b``: warm-up forwards, then one forward / one backward, then the remaining backwards.

Forward ``F{i}`` on stage ``s``: receive micro-batch ``i``'s activation from ``s-1`` (the first
stage takes the input itself), run the stage, send the output to ``s+1`` (the last stage computes
the loss, divided by ``m`` so that the gradients add up to the full batch's mean). Backward
``B{i}``: receive the output's gradient from ``s+1`` (the last stage starts from its loss),
backpropagate through the stage, send the input's gradient to ``s-1``. Gradients accumulate over
the micro-batches; the optimizer steps after the flush. Every action is labelled
``pipeline:F{i}`` / ``pipeline:B{i}`` in profiler traces, and the receive inside it
``pipeline:recv``. A send leaves with the stage's next receive, in one ``batch_isend_irecv``
(:class:`.p2p.Mailbox`): two neighbours sending to each other at once cannot deadlock on NCCL.

On a GPU the labels must span *device* time, or the measured timeline and bubble are the CPU's
launch times. CUDA kernels run asynchronously, and on NCCL ``work.wait()`` only makes the compute
stream wait for the transfer: the CPU returns at once. So on CUDA the runner waits for its compute
stream (``torch.cuda.current_stream().synchronize()``, never a device-wide synchronize, which would
also wait for sends still in flight to a neighbour) after each receive and at the end of each
action. The receive label then ends when the data has arrived, and each action when its kernels
have run.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.profiler import record_function

from ..measure import saved_activations
from . import p2p
from .simulate import schedule_order

RUNTIME_SCHEDULES = ("naive", "gpipe", "1f1b")


class StageRunner:
    """Stage ``stage`` of ``p``: its layers, its neighbours' shapes, and the micro-batches in flight."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        p: int,
        in_shape,
        out_shape,
        dtype,
        device,
        loss_fn,
        peers: list[int] | None = None,
        group=None,
        mailbox_cls=None,
    ):
        """``peers[s]`` is the global rank that runs stage ``s`` (default: rank ``s``); ``group``
        the pipeline's process group (default: every rank). With 3D parallelism (notebook 07)
        each pipeline is one PP group, e.g. ranks ``[1, 5]`` of 8. ``mailbox_cls`` replaces
        :class:`.p2p.Mailbox` (exercise 05.3 runs a student's mailbox in this runtime).

        Every step also leaves its timing in :attr:`timings` (seconds, one dict per step): the
        schedule's ``span`` (from the first action to the last send completed), the stage's
        ``busy`` time inside it (its actions minus the waits in their receives), and their
        difference, the stage's ``bubble``."""
        self.module, self.stage, self.p = module, stage, p
        self.in_shape, self.out_shape = in_shape, out_shape
        self.dtype, self.device, self.loss_fn = dtype, device, loss_fn
        self.first, self.last = stage == 0, stage == p - 1
        self.peers = list(peers) if peers is not None else list(range(p))
        if len(self.peers) != p:
            raise ValueError(f"peers {self.peers} must name one rank per stage ({p} stages)")
        self.mailbox = (mailbox_cls or p2p.Mailbox)(group)
        self.timings: list[dict] = []
        self._busy = 0.0
        self._work_from = 0.0  # when the current action's work began (after its receive)
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.held: dict[int, int] = {}
        self.held_bytes = self.peak_held_bytes = 0
        self.micro_bytes: list[int] = []

    def _wait_for_device(self) -> None:
        """On CUDA, block until this stage's compute stream has run what was queued (see above)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _recv(self, shape, src: int) -> torch.Tensor:
        with record_function("pipeline:recv"):
            buf = self.mailbox.recv(shape, self.dtype, self.device, src)
            self._wait_for_device()  # NCCL: wait() returned before the data arrived
        self._work_from = time.perf_counter()  # the wait was bubble, not work
        return buf

    def forward(self, i: int, x: torch.Tensor | None, y: torch.Tensor | None, m: int) -> None:
        self._work_from = time.perf_counter()
        with record_function(f"pipeline:F{i}"):
            self._forward(i, x, y, m)
            self._wait_for_device()
        self._busy += time.perf_counter() - self._work_from

    def _forward(self, i: int, x: torch.Tensor | None, y: torch.Tensor | None, m: int) -> None:
        if self.first:
            self.mailbox.flush()  # nothing to receive: let waiting sends go now
            inp = x
        else:
            inp = self._recv(self.in_shape, self.peers[self.stage - 1]).requires_grad_()
        with saved_activations() as mem:
            out = self.module(inp)  # (B/m, ...) -> (B/m, ...)
            if self.last:
                out = self.loss_fn(out, y) / m  # scalar: this micro-batch's share of the mean loss
        if not self.last:
            self.mailbox.send(out, self.peers[self.stage + 1])
        self.inputs[i], self.outputs[i] = inp, out
        self.held[i] = mem["bytes"]
        self.micro_bytes.append(mem["bytes"])
        self.held_bytes += mem["bytes"]
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def backward(self, i: int) -> None:
        self._work_from = time.perf_counter()
        with record_function(f"pipeline:B{i}"):
            out = self.outputs.pop(i)
            if self.last:
                self.mailbox.flush()
                out.backward()
            else:
                out.backward(self._recv(self.out_shape, self.peers[self.stage + 1]))
            inp = self.inputs.pop(i)
            if not self.first:
                self.mailbox.send(inp.grad, self.peers[self.stage - 1])
            self.held_bytes -= self.held.pop(i)
            self._wait_for_device()
        self._busy += time.perf_counter() - self._work_from

    def finish(self) -> None:
        self.mailbox.wait_all()


def train_step(runner: StageRunner, schedule: str, micro_x: list, micro_y: list) -> list[float]:
    """One training step of ``schedule`` on this stage; returns the last stage's micro-batch losses."""
    if schedule not in RUNTIME_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {RUNTIME_SCHEDULES}")
    m = len(micro_y) if micro_y is not None else len(micro_x)
    name = "gpipe" if schedule == "naive" else schedule
    losses = []
    runner._busy, start = 0.0, time.perf_counter()
    with record_function("pipeline:step"):  # the schedule alone: no data, no optimizer
        for action in schedule_order(name, runner.p, m, 1)[runner.stage]:
            i = action.micro
            if action.kind == "F":
                runner.forward(
                    i, micro_x[i] if runner.first else None, micro_y[i] if runner.last else None, m
                )
                if runner.last:
                    losses.append(runner.outputs[i].item() * m)
            else:
                runner.backward(i)
        runner.finish()
    span = time.perf_counter() - start
    runner.timings.append({"span": span, "busy": runner._busy, "bubble": span - runner._busy})
    return losses
