# med-ddpm-bench: `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0
DEMO_DIR ?= outputs/demo
SWEEP_DIR ?= results/bench
PRESET ?= evidence
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH (set PY=python3.x)"; exit 1; }
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# CPU machines get the pinned CPU wheel; a loose pin would pull a multi-GB CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/pip install -q torch; else $(BIN)/pip install -q $(TORCH_CPU); fi
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install torch (CPU wheel on CPU machines) + the project (editable, dev extras)

# A pytest-xdist worker per core in test and test-e2e only: the gpu and slow tests share one card or time kernels,
# and the device machine's pytest has no xdist.
test: $(STAMP) ## run the fast CPU test suite (gpu/slow/e2e deselected, a worker per core); fails if no test runs
	$(BIN)/python -m pytest -q -n auto

test-e2e: $(STAMP) ## run the tests that start commands of their own, end to end (CI's second step)
	$(BIN)/python -m pytest -q -n auto -m e2e

test-wheel: $(STAMP) ## build the wheel, install it in a fresh venv, tiny train + sample + bench report outside the repo
	PY=$(PY) TORCH_CPU=$(TORCH_CPU) .ci/test-wheel $(BIN)/python

test-gpu: $(STAMP) ## run the GPU tests that fit one 10-minute device call (on a CUDA machine)
	$(BIN)/python -m pytest -q -m gpu

test-gpu-long: $(STAMP) ## run the long GPU tests (compiled 128^3 stacks), a call of their own
	$(BIN)/python -m pytest -q -m gpu_long

test-slow: $(STAMP) ## run the slow tests
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP) ## ruff check
	$(BIN)/ruff check med_ddpm optim bench tests

# One CPU thread: on a 2-core box shared with other work two OpenMP threads spin-wait for each other and a
# tiny training step takes several times longer; an idle box loses little.
demo: export OMP_NUM_THREADS := 1
demo: $(STAMP) ## train the tiny model on synthetic phantoms, sample, bench-smoke + report (reruns retrain)
	@# train and sample refuse an output_dir holding an earlier run's results: a rerun starts them afresh;
	@# the sweep keeps earlier runs' rows and its report shows the latest run's (bench.core.records run ids)
	rm -rf $(DEMO_DIR)/train $(DEMO_DIR)/samples
	$(BIN)/python -m med_ddpm.train experiment=smoke output_dir=$(DEMO_DIR)/train
	$(BIN)/python -m med_ddpm.sample experiment=smoke checkpoint=$(DEMO_DIR)/train/checkpoints/last.pt output_dir=$(DEMO_DIR)/samples
	$(MAKE) --no-print-directory bench-smoke SWEEP_DIR=$(DEMO_DIR)/bench
	@echo "demo outputs: $(DEMO_DIR)/samples (NIfTI + PNG), $(DEMO_DIR)/bench/report.md"

bench-smoke: $(STAMP) ## tiny-model CPU sweep over a few recipes (about a minute), then its report (latest run)
	$(BIN)/python -m bench.sweep -m experiment=bench_smoke 'recipe=[],[channels_last_3d],[amp_bf16]' hydra.sweep.dir=$(SWEEP_DIR)
	$(BIN)/python -m bench.report dir=$(SWEEP_DIR)
	@cat $(SWEEP_DIR)/report.md

stamp: $(STAMP) ## record git's commit in .provenance.json for a copy of this tree without .git (a GPU machine)
	$(BIN)/python -m bench.stamp

bench: $(STAMP) ## this GPU's whole evidence, one run (PRESET=evidence; SWEEP_DIR=bench/results/h100), then its report
	$(BIN)/python -m bench.ladder preset=$(PRESET) out=$(SWEEP_DIR) $(LADDER_ARGS)
	$(BIN)/python -m bench.report dir=$(SWEEP_DIR)

profile: $(STAMP) ## kernel-level breakdown of one recipe stack (RECIPE='[amp_bf16]' BENCH=train_step PROFILE_ARGS=...)
	$(BIN)/python -m bench.profile 'recipe=$(or $(RECIPE),[])' bench=$(or $(BENCH),train_step) $(PROFILE_ARGS)

counters: $(STAMP) ## Nsight Compute counters of one recipe stack (RECIPE='[tf32]' BENCH=denoise_step COUNTERS_ARGS=...)
	$(BIN)/python -m bench.counters $(if $(RECIPE),'recipe=$(RECIPE)') bench=$(or $(BENCH),train_step) $(COUNTERS_ARGS)

report: $(STAMP) ## report.md/report.csv/PNGs for a sweep directory (SWEEP_DIR=...)
	$(BIN)/python -m bench.report dir=$(SWEEP_DIR)

clean: ## remove outputs (keeps .venv)
	rm -rf outputs multirun results .pytest_cache

.PHONY: help install test test-e2e test-wheel test-gpu test-gpu-long test-slow lint demo bench-smoke stamp bench profile counters report clean
