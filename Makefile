# The course's commands. `make help` lists them.
PYTHON ?= python3
# The Python environments are made from, found before this file puts .venv/bin first on PATH
# (a `module load` Python, say; never the checkout's own venv).
BASE_PYTHON := $(shell command -v $(PYTHON) 2>/dev/null || echo $(PYTHON))
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
KERNEL := distributed-course
KSPEC  := $(VENV)/share/jupyter/kernels/$(KERNEL)/kernel.json
# Notebooks run against this tree's venv whatever the caller's PATH says, and their kernel
# ('distributed-course', named in every notebook) is this tree's: JUPYTER_PATH is searched first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export JUPYTER_PATH := $(CURDIR)/$(VENV)/share/jupyter$(if $(JUPYTER_PATH),:$(JUPYTER_PATH))

.PHONY: help setup hub-env lab update course student answers test test-fast test-floor test-contended test-corpus preflight gpu-check lint format doctor clean FORCE
COPIES ?= student

help:
	@echo "make setup   create .venv from requirements.txt, install course_utils, register the '$(KERNEL)' kernel"
	@echo "             TORCH_INDEX=<url> another torch build (cpu, cuXXX, rocmX.Y); USE_SYSTEM_TORCH=1 the site's torch"
	@echo "make hub-env PREFIX=<dir> [KERNEL_PREFIX=/usr/local] one shared environment and kernel for every hub user"
	@echo "make lab     open JupyterLab on your working copies in work/ (COPIES=answers for an instructor)"
	@echo "make update  after git pull: refresh work/ (notebooks you edited are kept, new version beside)"
	@echo "make course  execute every notebook headless into build/ (ipynb + html) with a timing table"
	@echo "make preflight [SIZE=gpu]  check this node before a session: one report in build/preflight/"
	@echo "make gpu-check [DRY=1]     every GPU measurement in one run (under 9 min on one H100): build/gpu-check/"
	@echo "make student copies without solutions into build/student/ (exercises raise NotImplementedError)"
	@echo "make answers copies with the model answers, markers removed, into build/answers/"
	@echo "make test    unit + multi-process tests, then nbval over every notebook at the ci size"
	@echo "make lint    ruff check + format check + the package's import layers (.importlinter)"
	@echo "make doctor  what this node has: GPUs, interconnect, working backends, chosen size"
	@echo "make test-fast       the tests that are neither slow nor notebooks, at the ci size"
	@echo "make test-floor      the version-dependent tests on the oldest torch supported (.venv-floor)"
	@echo "make test-contended [REPEAT=3]  every notebook at the ci size, and the schedule effects under"
	@echo "                     modelled compute, while two busy loops hold the cores"
	@echo "make test-corpus     every exercise check on every solution in tests/fixtures/solutions"
	@echo "make format  ruff format + ruff check --fix"
	@echo "make clean   remove build/ and the tools' caches"

setup: $(STAMP) $(KSPEC)

# How torch is installed (scripts/setup_env.py says more): from requirements.txt (default), from a
# PyTorch index (TORCH_INDEX=<url>, TORCH_PINS="torch==X torchvision==Y" for other versions), or
# the torch the site's module already provides (USE_SYSTEM_TORCH=1). The venv remembers its choice;
# giving one of these variables again rebuilds it if the choice changed.
TORCH_ARGS := $(if $(TORCH_INDEX),--torch-index '$(TORCH_INDEX)') $(if $(TORCH_PINS),--torch-pins '$(TORCH_PINS)') \
              $(if $(filter 1 yes true,$(USE_SYSTEM_TORCH)),--system-torch) \
              $(if $(filter 0 no false,$(USE_SYSTEM_TORCH)),--default-torch)
ifneq ($(strip $(TORCH_ARGS)),)
$(STAMP): FORCE
endif
FORCE:

$(STAMP): requirements.txt pyproject.toml scripts/setup_env.py
	@$(BASE_PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 is needed, found " + sys.version.split()[0]'
	$(BASE_PYTHON) scripts/setup_env.py --venv $(VENV) --python $(BASE_PYTHON) $(TORCH_ARGS)
	touch $(STAMP)

# One environment for every user of a JupyterHub, built once by an instructor; students install
# nothing. KERNEL_PREFIX is where the hub's Jupyter looks for kernels (/usr/local, /usr, or the
# prefix of the hub's own environment); DATA_DIR a shared dataset folder.
KERNEL_PREFIX ?= /usr/local
hub-env:
	@test -n "$(PREFIX)" || { echo "usage: make hub-env PREFIX=/shared/distributed-course [KERNEL_PREFIX=/usr/local] [DATA_DIR=...] [USE_SYSTEM_TORCH=1]"; exit 2; }
	$(BASE_PYTHON) scripts/setup_env.py --venv $(PREFIX)/venv --python $(BASE_PYTHON) --hub \
	  --kernel-prefix $(KERNEL_PREFIX) $(if $(DATA_DIR),--data-dir $(DATA_DIR)) $(TORCH_ARGS)

# The kernel every notebook names. Inside the venv for make lab / test / course; with --user too,
# so that a JupyterHub's own Jupyter server offers it to this user.
$(KSPEC): $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Distributed training course" >/dev/null
	$(PY) -m ipykernel install --user --name $(KERNEL) --display-name "Distributed training course" >/dev/null

lab: setup
	$(PY) -m course_utils workspace --dir work --kind $(COPIES)
	$(PY) -m jupyter lab work/

update: setup
	$(PY) -m course_utils workspace --dir work --kind $(COPIES)

course: setup
	$(PY) -m course_utils course --out build

student: setup
	$(PY) -m course_utils copies --kind student --out build/student

answers: setup
	$(PY) -m course_utils copies --kind answers --out build/answers

test: setup
	COURSE_SIZE=$${COURSE_SIZE:-ci} COURSE_CHECK_DEVICES=1 $(PY) -m pytest tests notebooks -m "not contended" --nbval-lax --nbval-cell-timeout=600 --durations=40

# The instructor's check of this node before a session (course_utils/tooling/preflight.py): doctor, an
# all_reduce on every backend, the collective benchmark and every notebook at SIZE (default: gpu
# when the notebooks' ranks would run on GPUs, one each or shared, else cpu). Report: $(PREFLIGHT_OUT)/preflight.md and .json.
PREFLIGHT_OUT ?= build/preflight
preflight: setup
	$(PY) -m course_utils preflight --out $(PREFLIGHT_OUT) $(if $(SIZE),--size $(SIZE))

# Every GPU measurement of the course in one prepared run, each step with its own time limit
# (scripts/gpu_check.py says which and why): report in $(GPU_CHECK_OUT)/gpu_check.md and .json.
# DRY=1: the same steps on the CPU at the ci size (CI runs it). Without make, on a machine that
# has torch but no venv: python3 scripts/gpu_check.py --out DIR [--wheels .whl] (scripts/gpu_wheels.sh).
GPU_CHECK_OUT ?= build/gpu-check
gpu-check: setup
	$(PY) scripts/gpu_check.py --out $(GPU_CHECK_OUT) $(if $(filter 1 yes true,$(DRY)),--dry)

# Every notebook at the ci size, and the schedule effects under modelled compute, while two busy
# loops hold the cores (a shared node); see README.
# REPEAT=3 runs it three times in a row (a timing assertion that passes once may be luck).
REPEAT ?= 1
test-contended: setup
	for i in $$(seq $(REPEAT)); do \
	  COURSE_CHECK_DEVICES=1 $(PY) -m pytest tests/test_notebooks_contended.py tests/test_modelled.py \
	    -m contended -p no:cacheprovider || exit 1; done

# Every exercise check on every solution of tests/fixtures/solutions (make test runs all of the
# single-process ones and two correct and two wrong of each exercise that starts ranks).
test-corpus: setup
	COURSE_SIZE=ci COURSE_CORPUS=all $(PY) -m pytest tests/test_corpus.py -p no:cacheprovider

test-fast: setup
	COURSE_SIZE=ci $(PY) -m pytest tests -m "not slow and not notebook"

# On the oldest torch the course supports (CI runs this too): the tests marked `floor`, those that
# touch an API whose behaviour changed between versions, and a smoke set of the launcher.
FLOOR_VENV ?= .venv-floor
test-floor:
	$(BASE_PYTHON) scripts/setup_env.py --venv $(FLOOR_VENV) --python $(BASE_PYTHON) --torch-pins "$$($(BASE_PYTHON) scripts/setup_env.py --print-floor)"
	COURSE_SIZE=ci COURSE_CHECK_DEVICES=1 $(FLOOR_VENV)/bin/python -m pytest tests -m "floor and not slow and not notebook" -p no:cacheprovider --durations=15

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

doctor: setup
	$(PY) -m course_utils doctor

clean:
	rm -rf build .pytest_cache .ruff_cache
