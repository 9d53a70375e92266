#!/usr/bin/env bash
# Stage the datasets where offline compute nodes can read them. Run it on a login (or transfer)
# node, which has internet, once per course:
#   COURSE_DATA_DIR=/project/shared/course-data slurm_templates/stage_data.sh [cifar100 cifar10]
# Jobs then read $COURSE_DATA_DIR (a shared filesystem), or copy it to node-local disk first with
# the training scripts' --stage-to "$LOCAL_SCRATCH" (local rank 0 of every node copies).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export COURSE_DIR="${COURSE_DIR:-$(dirname "$here")}"
COURSE_PYTHON="${COURSE_PYTHON:-$COURSE_DIR/.venv/bin/python}"
: "${COURSE_DATA_DIR:?set COURSE_DATA_DIR to a folder the compute nodes can read}"
if [ $# -eq 0 ]; then set -- cifar100 cifar10 fashionmnist; fi
"$COURSE_PYTHON" -m course_utils data download --root "$COURSE_DATA_DIR" --datasets "$@"
chmod -R a+rX "$COURSE_DATA_DIR"   # students' jobs read it under their own accounts
echo "staged in $COURSE_DATA_DIR; jobs: export COURSE_DATA_DIR=$COURSE_DATA_DIR"
