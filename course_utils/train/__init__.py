"""Training entry points for clusters: the course's workloads as scripts.

Each module has a ``main(argv)`` and runs unchanged under ``torchrun``, under ``srun`` alone (one
task per GPU) and under :func:`course_utils.launch`, because it sets itself up with
:func:`course_utils.dist.init`. The thin files in the repository's ``train/`` folder call them::

    torchrun --standalone --nproc-per-node 4 train/ddp.py --size gpu --data-dir $COURSE_DATA_DIR
    srun --ntasks-per-node 4 --gpus-per-task 1 python train/ddp.py --job-dir $JOB_DIR
    python -c "from course_utils import launch; launch('train/ddp.py', 2, argv=['--size', 'ci'])"

- :mod:`.ddp`: DDP on CIFAR-100 with the course's ResNet, AMP and the profiler schedule;
- :mod:`.zero`: the same workload with FSDP2 (``fully_shard``) or the course's ZeRO-1/2;
- :mod:`.threed`: notebook 07's DP x PP x TP composition, checked against one process.

What they share (arguments, the job directory, checkpoints, logs) is in :mod:`.common`. Their
imports are absolute, so each module's file also runs as a script path where the repository's
``train/`` folder is not at hand (a hub environment): notebook 03 launches ``ddp.__file__``.
"""
