"""course_utils: the helper package behind the distributed-training course notebooks.

The notebooks teach; this package serves them: the launcher that starts real
ranks (:func:`launch`), rank set-up for scripts (:mod:`course_utils.dist`),
problem sizes (:mod:`course_utils.sizes`), data (:mod:`course_utils.data`),
models, measurement and plots. ``python -m course_utils doctor`` checks a node.
"""

from .launcher import (
    LaunchError,
    LaunchInterrupted,
    LaunchResult,
    RankContext,
    RankFailedError,
    RankTimeoutError,
    launch,
    load_results,
)

__version__ = "0.1.0"

__all__ = [
    "LaunchError",
    "LaunchInterrupted",
    "LaunchResult",
    "RankContext",
    "RankFailedError",
    "RankTimeoutError",
    "launch",
    "load_results",
]
