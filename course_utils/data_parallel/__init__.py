"""Data parallelism: the from-scratch DDP reference (:class:`BucketedDDP`) and its communication.

Built step by step in notebook 03; reused by later notebooks.
"""

from .ddp import BucketedDDP

__all__ = ["BucketedDDP"]
