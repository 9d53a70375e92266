"""What a pipeline sends: activations forward, their gradients backward, between neighbours only.

Forward: stage ``s`` sends its output for micro-batch ``i``, shape ``(B/m, ...)``, to stage
``s+1``. Backward: stage ``s+1`` sends the gradient with respect to that tensor (same shape)
back to stage ``s``. Both sides know the shape in advance (:func:`..partition.boundary_shapes`),
so the receiver allocates the buffer itself and only the data travels. Sends are non-blocking
(``isend``): in 1F1B two neighbours can send to each other at the same moment, and two blocking
sends would wait for each other forever. Receives block until the data is there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def send(tensor: torch.Tensor, dst: int, pending: list) -> None:
    """Start sending ``tensor`` to rank ``dst``; the handle (and the tensor) go in ``pending``."""
    t = tensor.detach().contiguous()
    pending.append((dist.isend(t, dst), t))


def recv(shape, dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    """Receive a tensor of known ``shape`` and ``dtype`` from rank ``src``."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src)
    return buf


def wait_all(pending: list) -> None:
    """Wait until every started send has completed (before buffers are reused or the step ends)."""
    for work, _ in pending:
        work.wait()
    pending.clear()
