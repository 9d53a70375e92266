"""What a pipeline sends: activations forward, their gradients backward, between neighbours only.

Forward: stage ``s`` sends its output for micro-batch ``i``, shape ``(B/m, ...)``, to stage
``s+1``. Backward: stage ``s+1`` sends the gradient with respect to that tensor (same shape)
back to stage ``s``. Both sides know the shape in advance (:func:`..partition.boundary_shapes`),
so the receiver allocates the buffer itself, on its device, and only the data travels.

In 1F1B two neighbours send to each other at the same moment: stage ``s`` sends an activation
to ``s+1`` and waits for a gradient from it, while ``s+1`` sends that gradient and waits for the
next activation. With NCCL, a send and a receive issued one after the other on the same
communicator run in order, and for large messages each send waits for its matching receive:
both ranks sit in their send forever. So a send is not issued on its own. It waits in
:class:`Mailbox` until the stage's next receive and goes out *with* it in one
``batch_isend_irecv`` (NCCL runs a batch as one group, in any order), as Megatron-LM's
``send_forward_recv_backward`` does. A stage whose next action receives nothing flushes its
waiting sends at the start of that action, so nothing is held back longer than one action.
gloo accepts the same batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Mailbox:
    """One stage's outgoing sends, batched with its next receive."""

    def __init__(self, group=None):
        self.group = group  # the pipeline's process group; peers are global ranks
        self.outgoing: list[tuple[torch.Tensor, int]] = []  # (tensor, destination rank)
        self.in_flight: list[tuple[object, list[torch.Tensor]]] = []  # (work, tensors it uses)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Queue ``tensor`` for rank ``dst``; it leaves with the next receive or :meth:`flush`."""
        self.outgoing.append((tensor.detach().contiguous(), dst))

    def _post(self, recv: dist.P2POp | None = None) -> list:
        ops = [dist.P2POp(dist.isend, t, dst, self.group) for t, dst in self.outgoing]
        if recv is not None:
            ops.append(recv)
        tensors = [t for t, _ in self.outgoing]
        self.outgoing = []
        return [(work, tensors) for work in dist.batch_isend_irecv(ops)] if ops else []

    def recv(self, shape, dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        """Receive a tensor of known ``shape`` and ``dtype`` from ``src``, sending what waits."""
        buf = torch.empty(shape, dtype=dtype, device=device)
        # On NCCL the batch's works are coalesced into one: wait for all of it.
        for work, _ in self._post(dist.P2POp(dist.irecv, buf, src, self.group)):
            work.wait()
        return buf

    def flush(self) -> None:
        """Send what waits now, without a receive (the stage's next action receives nothing)."""
        self.in_flight += self._post()

    def wait_all(self) -> None:
        """Send what waits and wait for every send to complete (before the step ends)."""
        self.flush()
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight.clear()
