"""Notebook 07's DP x PP x TP composition, checked against one process: see
course_utils/train/threed.py.

torchrun --standalone --nproc-per-node 8 train/threed.py --dp 2 --pp 2 --tp 2 --check
srun --ntasks-per-node 2 python train/threed.py --dp 2 --tp 2 --check
"""

import sys

from course_utils.train.common import exit_now
from course_utils.train.threed import main

if __name__ == "__main__":
    main(sys.argv[1:])
    exit_now()  # results are written; see exit_now for why not a normal exit
