"""Real ranks from a notebook: :func:`launch`. See DESIGN.md, "The launcher contract"."""

from .. import sizes
from .api import LaunchResult, launch, load_results, resolve_backend
from .context import RankContext
from .errors import LaunchError, LaunchInterrupted, RankFailedError, RankTimeoutError
from .placement import describe_placement, place_ranks

sizes.use_placement(place_ranks)  # the size follows where the ranks would run

__all__ = [
    "LaunchError",
    "LaunchInterrupted",
    "LaunchResult",
    "RankContext",
    "RankFailedError",
    "RankTimeoutError",
    "describe_placement",
    "launch",
    "load_results",
    "place_ranks",
    "resolve_backend",
]
