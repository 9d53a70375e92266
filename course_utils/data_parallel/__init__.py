"""Data parallelism from scratch: notebook 03's steps (a) and (b) (:mod:`.steps`), the finished
reference (:class:`BucketedDDP`) and its communication.

Built step by step in notebook 03; reused by later notebooks.
"""

from .ddp import BucketedDDP
from .steps import BucketedNoOverlapDDP, NaiveDDP

__all__ = ["BucketedDDP", "BucketedNoOverlapDDP", "NaiveDDP"]
