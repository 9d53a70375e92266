"""Pipeline parallelism: schedule simulator, partitioning, P2P, the from-scratch runtime.

- :mod:`.simulate`: GPipe / 1F1B / interleaved schedules on paper, bubble and memory, Gantt charts;
- :mod:`.partition`: cut an ``nn.Sequential`` into balanced stages;
- :mod:`.p2p`: what travels between neighbouring stages;
- :mod:`.schedules`: naive / GPipe / 1F1B executed for real, one stage per rank;
- :mod:`.run`: argument checks and the launch;
- :mod:`.parity`: the per-rank worker (the course's schedules or ``torch.distributed.pipelining``)
  beside one process.

Taught in notebook 05.
"""

from .simulate import simulate, theory_bubble

__all__ = ["simulate", "theory_bubble"]
