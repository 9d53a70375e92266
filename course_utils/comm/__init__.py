"""Communication, counted once: the ring collectives' ledger and the dispatcher mode that sees
every call into torch.distributed.

- :mod:`.ledger`: messages and bytes of each ring collective (``ring_factor``, ``ring_bytes``);
- :mod:`.counting`: :class:`CommunicationMode`, and :class:`CollectiveCounter` and
  :class:`AllToAllCounter` built on it; the exercise checks' watchers subclass it too.
"""

from .counting import AllToAllCounter, Call, CollectiveCounter, CommunicationMode
from .ledger import OPS, ring_bytes, ring_factor, ring_steps, volume

__all__ = [
    "OPS",
    "AllToAllCounter",
    "Call",
    "CollectiveCounter",
    "CommunicationMode",
    "ring_bytes",
    "ring_factor",
    "ring_steps",
    "volume",
]
