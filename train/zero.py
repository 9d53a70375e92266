"""The DDP workload sharded with FSDP2 or the course's ZeRO-1/2: see course_utils/train/zero.py.

torchrun --standalone --nproc-per-node 4 train/zero.py --method fsdp2 --size gpu
srun --ntasks-per-node 4 --gpus-per-task 1 python train/zero.py --method zero2
"""

import sys

from course_utils.train.common import exit_now
from course_utils.train.zero import main

if __name__ == "__main__":
    # results are written; see exit_now for why not a normal exit, and for its status after a stop
    exit_now(main(sys.argv[1:]))
