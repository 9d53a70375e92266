"""DDP on CIFAR-100 with a ResNet, AMP and the profiler: see course_utils/train/ddp.py.

torchrun --standalone --nproc-per-node 4 train/ddp.py --size gpu
srun --ntasks-per-node 4 --gpus-per-task 1 python train/ddp.py
"""

import sys

from course_utils.train.common import exit_now
from course_utils.train.ddp import main

if __name__ == "__main__":
    # results are written; see exit_now for why not a normal exit, and for its status after a stop
    exit_now(main(sys.argv[1:]))
