# The course's commands. `make help` lists them.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
KERNEL := distributed-course
KSPEC  := $(VENV)/share/jupyter/kernels/$(KERNEL)/kernel.json
# Notebooks run against this tree's venv whatever the caller's PATH says, and their kernel
# ('distributed-course', named in every notebook) is this tree's: JUPYTER_PATH is searched first.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export JUPYTER_PATH := $(CURDIR)/$(VENV)/share/jupyter$(if $(JUPYTER_PATH),:$(JUPYTER_PATH))

.PHONY: help setup lab update course student answers test test-fast lint format doctor clean
COPIES ?= student

help:
	@echo "make setup   create .venv from requirements.txt, install course_utils, register the '$(KERNEL)' kernel"
	@echo "make lab     open JupyterLab on your working copies in work/ (COPIES=answers for an instructor)"
	@echo "make update  after git pull: refresh work/ (notebooks you edited are kept, new version beside)"
	@echo "make course  execute every notebook headless into build/ (ipynb + html) with a timing table"
	@echo "make student copies without solutions into build/student/ (exercises raise NotImplementedError)"
	@echo "make answers copies with the model answers, markers removed, into build/answers/"
	@echo "make test    unit + multi-process tests, then nbval over every notebook at the ci size"
	@echo "make lint    ruff check + format check"
	@echo "make doctor  what this node has: GPUs, interconnect, working backends, chosen size"

setup: $(STAMP) $(KSPEC)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 is needed, found " + sys.version.split()[0]'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . || \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

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
	COURSE_SIZE=$${COURSE_SIZE:-ci} COURSE_CHECK_DEVICES=1 $(PY) -m pytest tests notebooks --nbval-lax --nbval-cell-timeout=600

test-fast: setup
	COURSE_SIZE=ci $(PY) -m pytest tests -m "not slow and not notebook"

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

doctor: setup
	$(PY) -m course_utils doctor

clean:
	rm -rf build .pytest_cache .ruff_cache
