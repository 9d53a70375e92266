"""The trivial job timed by ``bench launch`` under torchrun and raw spawn: one all_reduce.

torchrun --standalone --nproc-per-node 4 course_utils/bench/allreduce_script.py
"""

import torch
import torch.distributed as dist


def run(
    rank: int | None = None, world_size: int | None = None, init_method: str = "env://"
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank if rank is not None else -1,
        world_size=world_size if world_size is not None else -1,
    )
    t = torch.ones(1024)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size()
    dist.destroy_process_group()


def spawn_rank(rank: int, world_size: int, init_method: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn`` (the rank index comes first)."""
    torch.set_num_threads(1)
    run(rank, world_size, init_method)


if __name__ == "__main__":
    run()
