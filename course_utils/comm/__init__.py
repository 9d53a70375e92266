"""Communication, counted once: the ring collectives' ledger and the dispatcher mode that sees
every call into torch.distributed.

- :mod:`.ledger`: messages and bytes of each ring collective (``ring_factor``, ``ring_bytes``);
- :mod:`.model`: the α–β model of a link (:class:`AlphaBeta`, ``fit``) and the ping-pong that
  measures one (notebook 03), used by the planner;
- :mod:`.counting`: :class:`CommunicationMode`, and :class:`CollectiveCounter` and
  :class:`AllToAllCounter` built on it; the exercise checks' watchers subclass it too.
"""

from .counting import AllToAllCounter, Call, CollectiveCounter, CommunicationMode
from .ledger import OPS, ring_bytes, ring_factor, ring_steps, volume
from .model import AlphaBeta, fit, ping_pong_worker

__all__ = [
    "OPS",
    "AlphaBeta",
    "AllToAllCounter",
    "Call",
    "CollectiveCounter",
    "CommunicationMode",
    "fit",
    "ping_pong_worker",
    "ring_bytes",
    "ring_factor",
    "ring_steps",
    "volume",
]
