#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for `make gpu-check`, fetched here (where PyPI answers) into
# a git-ignored folder that travels with the working tree (the device tool's `carry`).
#
#   bash scripts/gpu_wheels.sh [DIR]      # default DIR: .whl
#
# That machine (one H100 or H200, see the device tool's KINDS.md) has Python 3.12, torch 2.11 and a
# scientific stack (numpy, pandas, matplotlib, cloudpickle, networkx, narwhals, pytest,
# pytest-timeout, pytest-xdist, psutil, ...), but no Jupyter, no msgspec, no Holistic Trace
# Analysis and no network. scripts/gpu_check.py installs these with
#   pip install --no-index --no-deps --target <site> DIR/*.whl
# and puts <site> on PYTHONPATH. --no-deps: every wheel it needs is named here, once, at the version
# requirements.txt pins or that pip resolved for it on 2026-11-26; packages the machine already has
# are not carried. Together they must stay under the 64 MiB the working tree may weigh; the script
# fails if they do not.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
LIMIT_MIB=${LIMIT_MIB:-56}  # 64 MiB in all, the repository itself included

# What the course and the check import that the machine's image does not list:
WHEELS=(
  # course_utils' own dependency (trace parsing)
  msgspec==0.22.0
  # executing notebooks: nbclient and a Python kernel
  nbclient==0.11.0 nbformat==5.11.1 jupyter_client==8.10.0 jupyter_core==5.9.1 traitlets==5.16.1
  platformdirs==4.14.8 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 pyzmq==27.3.0 tornado==6.6.1
  ipykernel==7.4.0 comm==0.2.3 debugpy==1.8.22 nest-asyncio2==1.7.4 matplotlib-inline==0.2.2
  ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 parso==0.8.7 pexpect==4.9.0
  ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 asttokens==3.0.2
  executing==2.3.0 pure_eval==0.2.4
  # launch's progress row in a notebook, notebook 04's step slider
  ipywidgets==8.1.9 widgetsnbextension==4.0.16 jupyterlab_widgets==3.0.17
  # the repository's conftest.py loads the nbval student plugin
  nbval==0.11.0
  # Holistic Trace Analysis beside the course's trace analysis (notebook 04, the check's trace step)
  HolisticTraceAnalysis==0.5.0 plotly==7.1.0 pydot==4.0.1
)

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DIR" \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  "${WHEELS[@]}"

count=$(ls "$DIR"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "gpu_wheels: expected ${#WHEELS[@]} wheels in $DIR, found $count" >&2
  exit 1
fi
mib=$(du -cm "$DIR"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: $count wheels, $mib MiB in $DIR"
if [ "$mib" -gt "$LIMIT_MIB" ]; then
  echo "gpu_wheels: $mib MiB is over the $LIMIT_MIB MiB that may travel beside the repository" >&2
  exit 1
fi
