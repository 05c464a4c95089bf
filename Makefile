# Thin targets. Each one creates .venv on first use (or when requirements change).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: book site test test-durations check lab bench gpu-check clean venv notebooks train cluster-up cluster-down

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# pip would compile the ~18,000 modules to bytecode on one core (half of the install's time); compileall
	@# writes the same .pyc files on every core. Like pip, it passes over the few files that do not compile
	@# under this Python (e.g. torch's py312_intrinsics.py).
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt
	$(BIN)/python -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (scalebook)" > /dev/null
	@# Build matplotlib's font cache now: on a fresh machine its one-time notice would otherwise go to a
	@# chapter's stderr, which the book build treats as a warning (_config.yml, stderr_output: warn).
	$(BIN)/python -c "import matplotlib.font_manager" 2> /dev/null
	@touch $@

## book: execute every notebook (cached) and build the offline site into _build/html
book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going
	@echo
	@echo "The book is built. Open file://$(CURDIR)/_build/html/index.html"

## site: the deployable site in _build/site, built from the committed outputs (nothing executes); BASEURL= the address
## it is published at (default: html.baseurl of _config.yml). .github/workflows/pages.yml publishes it
site: $(STAMP)
	$(BIN)/python book/build_site.py _build/site $(if $(BASEURL),--baseurl "$(BASEURL)")

## test: nbval over every notebook first, then unit and distributed tests, the book build (from the
## committed outputs, so nothing executes twice) and the browser checks
## Two pytest-xdist workers (--dist loadscope, grouped by tests/conftest.py: a notebook, a module, the book's users
## and the SLURM users each stay on one worker); many tests wait on launches and subprocesses rather than compute.
## Every test is bounded by pytest-timeout (pyproject.toml). XDIST="-n 0" runs them in one process.
XDIST ?= -n 2 --dist loadscope
test: $(STAMP)
	$(BIN)/python -m pytest notebooks tests --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
		$(XDIST) --durations=25

## test-durations: `make test`, writing each xdist group's measured seconds to tests/group_durations.json (the
## workers take the longest groups first; commit the file after a run on the 2-core machine)
test-durations: $(STAMP)
	SCALEBOOK_GROUP_DURATIONS=$(CURDIR)/tests/group_durations.json $(MAKE) test

## check: the fast lane (about 3 min on 2 cores): ruff, then the unit and small distributed tests; leaves out what
## tests/conftest.py marks slow (notebooks, the book build, the browser, SLURM, CLI runs, launches of 4+ ranks)
check: $(STAMP)
	$(BIN)/ruff check code tests bench book/_ext
	$(BIN)/python -m pytest tests -m "not slow" $(XDIST)

## notebooks: re-execute every chapter and save it with its outputs (commit the result)
notebooks: $(STAMP)
	$(BIN)/python -m scalebook.notebook notebooks/*.ipynb

## lab: JupyterLab on the notebooks, their prose rendered by jupyterlab-myst; NB=notebooks/NN_name.ipynb opens that
## chapter; run as root (a container), it passes --allow-root. It serves the repository (not notebooks/ alone), so
## that a chapter's links to ../book/ pages open; tests/test_lab.py serves the lab with this very command line
lab: $(STAMP)
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) --ServerApp.root_dir="$(CURDIR)" \
		--LabApp.default_url=/lab/tree/$(or $(NB),notebooks)

## train: one training run on this machine; pass arguments with ARGS="--model small --steps 100"
train: $(STAMP)
	$(BIN)/python -m scalebook.train $(ARGS)

## cluster-up / cluster-down: a real two-node SLURM cluster on this machine, with accounting for sacct (root;
## needs slurm-wlm, munge, slurmdbd, mariadb-server); cluster-down stops every daemon cluster-up started
cluster-up: $(STAMP)
	$(BIN)/python -m scalebook.cluster up

cluster-down: $(STAMP)
	$(BIN)/python -m scalebook.cluster down

## bench: side-by-side benchmarks into bench/results/<date>-<machine>.json (commit it) and README.md's table; not in make test
bench: $(STAMP)
	$(BIN)/python bench/run.py

## gpu-check: on a machine with CUDA GPUs, every strategy on NCCL against one process, then GPT-2 124M's tokens/s,
## MFU and peak memory (ours and a plain PyTorch loop, torch.compile off and on), into bench/gpu/; without CUDA it
## says so and exits 0. It runs the machine's own PyTorch, not the CPU-pinned .venv: GPU_PYTHON (default python3
## when it imports torch, else .venv's), with code/ on PYTHONPATH (or `pip install --no-deps -e .` there first).
## Options through ARGS, e.g. ARGS="--skip-strategies --micro-batch 8"
GPU_PYTHON ?= $(shell python3 -c "import torch" 2> /dev/null && echo python3 || echo $(BIN)/python)
gpu-check:
	@if [ "$(GPU_PYTHON)" = "$(BIN)/python" ]; then $(MAKE) --no-print-directory venv; fi
	PYTHONPATH=code$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) bench/gpu_check.py $(ARGS)

clean:
	rm -rf _build .jupyter_cache .pytest_cache
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
