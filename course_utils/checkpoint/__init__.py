"""Checkpoints at scale: what each rank holds, saving it sharded, resharding, resuming exactly.

- :mod:`.sharded`: the from-scratch sharded checkpoint (:func:`save`, :func:`load`, :class:`Slice`,
  :func:`latest`): each rank writes its own file, rank 0 an index, renamed into place atomically;
- :mod:`.layouts`: each layout's slices (DDP, ZeRO-1/2/3, FSDP2, TP, PP), so that a checkpoint
  saved under one loads under another;
- :mod:`.dcp`: the same with ``torch.distributed.checkpoint``, synchronous and asynchronous;
- :mod:`.resume`: what a restart needs to equal an uninterrupted run bit for bit (RNG states, data
  position, step);
- :mod:`.interval`: Young's and Daly's checkpoint interval, goodput and its exact optimum
  (:func:`.interval.best_interval`), Llama 3's failure rate;
- :mod:`.contents`: the bytes a checkpoint holds per rank under each layout, by formula;
- :mod:`.failures`: a rank killed mid-step and the job resumed bit for bit under ``launch``, the
  work lost; :mod:`.elastic_demo`: the same under ``torchrun --max-restarts``;
- :mod:`.hangs`: a mismatched collective under launch's timeout and the process group's, and
  PyTorch's flight recorder.

Taught in notebook 11.
"""

from .sharded import Loaded, ShardedState, Slice, latest, load, read_index, save

__all__ = ["Loaded", "ShardedState", "Slice", "latest", "load", "read_index", "save"]
