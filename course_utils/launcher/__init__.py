"""Real ranks from a notebook: :func:`launch`. See DESIGN.md, "The launcher contract"."""

from .api import LaunchResult, launch, load_results, resolve_backend
from .context import RankContext
from .errors import LaunchError, LaunchInterrupted, RankFailedError, RankTimeoutError

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
