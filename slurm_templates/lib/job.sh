# Sourced by every template at the start of the job (on the first node of the allocation).
# Sets: the site's values, COURSE_PYTHON, JOB_DIR, MASTER_ADDR/MASTER_PORT, OMP_NUM_THREADS.
set -euo pipefail
export COURSE_DIR="${COURSE_DIR:-${SLURM_SUBMIT_DIR:?not inside a SLURM job}}"
export SITE="${SITE:-generic-nvidia}"
source "$COURSE_DIR/slurm_templates/lib/modules.sh"
source "$COURSE_DIR/slurm_templates/sites/$SITE.env"
site_setup
export COURSE_PYTHON="${COURSE_PYTHON:-$COURSE_DIR/.venv/bin/python}"
export SCRIPT="${SCRIPT:-train/ddp.py}"
export JOB_DIR="${JOB_DIR:-$JOBS_DIR/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}"
case "$JOB_DIR" in /*) ;; *) JOB_DIR="$SLURM_SUBMIT_DIR/$JOB_DIR" ;; esac  # as given at submit
mkdir -p "$JOB_DIR"
# Rendezvous on the first node, at the address SLURM itself uses for it; the port comes from the
# job id (jobs sharing a node get different ports unless their ids differ by a multiple of 20000),
# and nothing is fixed.
HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
if [ -z "${MASTER_ADDR:-}" ]; then
  MASTER_ADDR="$(scontrol show node "$HEAD_NODE" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')"
fi
if [ -z "$MASTER_ADDR" ]; then
  echo "could not read the address of $HEAD_NODE from scontrol: set MASTER_ADDR" >&2
  exit 1
fi
export MASTER_ADDR
export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
# One thread pool per rank, sized to the cores SLURM gave it (torch would otherwise start one
# thread per core of the node in every rank).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$CPUS_PER_RANK}"
cd "$COURSE_DIR"
echo "job ${SLURM_JOB_ID} (${SITE}): ${SLURM_JOB_NUM_NODES} node(s) [${SLURM_JOB_NODELIST}]," \
  "${RANKS_PER_NODE} ranks per node, rendezvous ${MASTER_ADDR}:${MASTER_PORT}, writing ${JOB_DIR}"
