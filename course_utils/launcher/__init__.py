"""Real ranks from a notebook: :func:`launch`. See DESIGN.md, "The launcher contract"."""

from .. import sizes
from .api import LaunchResult, launch, load_results, resolve_backend
from .context import RankContext
from .errors import LaunchError, LaunchInterrupted, RankFailedError, RankTimeoutError
from .placement import plan as _plan

sizes.use_placement(_plan)  # the size follows where the ranks would run

__all__ = [
    "LaunchError",
    "LaunchInterrupted",
    "LaunchResult",
    "RankContext",
    "RankFailedError",
    "RankTimeoutError",
    "launch",
    "load_results",
    "resolve_backend",
]
