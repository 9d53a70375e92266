"""Expert parallelism: a mixture-of-experts layer whose experts are spread over ranks.

- :mod:`.router`: :func:`route`, top-k gating with capacity, dropping and the load-balancing loss;
- :mod:`.layer`: :class:`MoE` (router + experts) and :class:`MoENet` on one device;
- :mod:`.comm`: the counts exchange and the variable-split all-to-all (``all_to_all_single``);
- :mod:`.apply`: :func:`apply_ep` (dispatch, local experts, combine) and :func:`sync_gradients`
  for EP with data parallelism;
- :mod:`.measure`: all-to-all volume and parameters total against active;
- :mod:`.parity` (imported on its own): the parity worker against one process.

Taught in notebook 10.
"""

from .apply import apply_ep, dispatch_combine, sync_gradients
from .comm import all_to_all, exchange_counts
from .layer import MoE, MoEConfig, MoENet
from .measure import all_to_all_values, moe_params
from .router import Routing, capacity, route

__all__ = [
    "MoE",
    "MoEConfig",
    "MoENet",
    "Routing",
    "all_to_all",
    "all_to_all_values",
    "apply_ep",
    "capacity",
    "dispatch_combine",
    "exchange_counts",
    "moe_params",
    "route",
    "sync_gradients",
]
