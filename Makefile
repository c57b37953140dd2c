# vLLM-AFD: the single entry point. `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3
AFD := PYTHONPATH=$(CURDIR)/scripts $(PY) -m afdtool
VENV ?= .venv
VPY := $(CURDIR)/$(VENV)/bin/python
PYTEST_ARGS ?=
# Upstream target: `make apply-patches VLLM_VERSION=X` / `make check VLLM_VERSION=X` (or TO=X)
# use targets/X/ (pin + patches, tree build/vllm-X); without it the primary pin (file VLLM_VERSION).
# Only a command-line VLLM_VERSION counts (an environment variable of that name is ignored).
ifeq ($(origin VLLM_VERSION),command line)
TO := $(VLLM_VERSION)
endif
TARGET_ARGS = $(if $(TO),--target $(TO))
# For a second target the wheel, venv and models are its own: build/vllm-X, .venv-X,
# build/models-X (`make venv VLLM_VERSION=0.32.0`, `make test-oracle VLLM_VERSION=0.32.0`).
ifneq ($(TO),)
ifneq ($(TO),$(shell sed -n 's/^VERSION=//p' VLLM_VERSION))
VENV := .venv-$(TO)
VPY := $(CURDIR)/$(VENV)/bin/python
TARGET_ENV := AFD_PIN_FILE=$(CURDIR)/targets/$(TO)/VLLM_VERSION
WHEEL_TREE := --tree build/vllm-$(TO)
MODELS := build/models-$(TO)
endif
endif
MODELS ?= build/models
REBASE_ARGS ?=
TREE_ARGS = $(if $(TREE),--tree $(TREE))

.DEFAULT_GOAL := help
.PHONY: help fetch apply-patches export-patches check wheel wheel-cpu venv models bundle \
        demo test test-unit test-cpu test-oracle test-target test-gpu lint clean \
        rebase rebase-continue rebase-abort rebase-report drift

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

fetch: ## download (or reuse from cache) the pinned sdist and wheels, sha256-checked
	$(AFD) fetch all

apply-patches: ## pinned vLLM source + overlay + patches/series -> build/vllm (git repo)
	$(AFD) apply $(TARGET_ARGS)

export-patches: ## commits after the overlay commit in build/vllm -> patches/ and overlay/
	$(AFD) export $(TARGET_ARGS)

check: ## series applies strictly, re-export is byte-identical, headers present, prefixes compile
	$(AFD) check $(TARGET_ARGS)

wheel: apply-patches ## custom CUDA wheel -> dist/vllm-X+afd.<rev>-cp38-abi3-manylinux_2_28_x86_64.whl
	$(TARGET_ENV) $(AFD) wheel --variant cuda $(WHEEL_TREE)

wheel-cpu: apply-patches ## custom CPU wheel -> dist/vllm-X+afd.<rev>.cpu-...whl
	$(TARGET_ENV) $(AFD) wheel --variant cpu $(WHEEL_TREE)

venv: wheel-cpu ## .venv with torch and the custom CPU wheel (no-op when up to date)
	$(TARGET_ENV) $(AFD) venv --venv $(VENV)

models: venv ## tiny deterministic random-weight checkpoints -> build/models/
	$(VPY) scripts/make_models.py --out $(MODELS)

bundle: wheel ## offline install bundle for the GPU host -> dist/bundle/ (parts <= 48 MiB)
	$(AFD) bundle

demo: models ## CPU: AFD (1 attention + 1 FFN server) vs plain vLLM, prints MATCH/MISMATCH
	$(VPY) scripts/demo.py --model build/models/qwen3_moe

# The unit tests run in the venv (torch, vLLM) against overlay/ as it is in the tree
# (tests/conftest.py); test_real_wheel and test_real_pinned_series need the upstream wheels
# and the sdist in the cache (`fetch`) and build/vllm (`venv` builds it).
test-unit: fetch venv ## unit tests in the venv: tooling and AFD logic (overlay/ as in the tree)
	$(VPY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-cpu: models ## real vLLM on the CPU: plain checkpoints and the AFD oracle
	$(VPY) -m pytest -q tests/cpu $(PYTEST_ARGS)

test: fetch models ## everything CI runs: lint, make check, unit and CPU tests
	$(MAKE) lint
	$(MAKE) check
	$(VPY) -m pytest -q --durations=30 tests/unit tests/cpu $(PYTEST_ARGS)

test-oracle: models ## the CPU oracle alone (AFD == plain vLLM); per target: VLLM_VERSION=X
	AFD_MODELS_DIR=$(CURDIR)/$(MODELS) $(VPY) -m pytest -q tests/cpu/test_afd_oracle.py $(PYTEST_ARGS)

# The second target runs the oracle file except what depends on no vLLM code that differs
# between targets beyond what its other cases start: the FFN group's 4A2F case (2A2F
# runs), its DBO refusal (overlay logic), the attention-first start order (overlay retry
# logic), and the wrong-topology handshake (the same refusal path as the mismatched
# layer count, which runs).
TARGET_DESELECT = --deselect "tests/cpu/test_afd_oracle.py::test_oracle_ffn_group[deepseek_v2-4A2F]" \
	--deselect tests/cpu/test_afd_oracle.py::test_ffn_group_refuses_micro_batched_steps \
	--deselect tests/cpu/test_afd_oracle.py::test_oracle_attention_started_first \
	--deselect tests/cpu/test_afd_oracle.py::test_wrong_topology_ends_both
test-target: models ## per-target CPU runtime check: oracle, vllm serve pair, metrics and profiling
	AFD_MODELS_DIR=$(CURDIR)/$(MODELS) $(VPY) -m pytest -q --durations=15 tests/cpu/test_afd_oracle.py \
		tests/cpu/test_afd_serve.py tests/cpu/test_afd_observability.py $(TARGET_DESELECT) $(PYTEST_ARGS)

test-gpu: ## GPU tests (run on the GPU host): pytest -m gpu
	$(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

lint: ## ruff over scripts, tests, overlay
	$(VPY) -m ruff check scripts tests overlay benchmarks

rebase: ## carry the series to release X: make rebase VLLM_VERSION=X [TREE=dir] [REBASE_ARGS=--drop-empty]
	$(if $(TO),,$(error usage: make rebase VLLM_VERSION=X (or TO=X)))
	$(AFD) rebase --to $(TO) $(TREE_ARGS) $(REBASE_ARGS)

rebase-continue: ## resume a stopped rebase after `git add` (REBASE_ARGS=--skip drops the patch)
	$(AFD) rebase-continue $(if $(TO),--to $(TO)) $(TREE_ARGS) $(REBASE_ARGS)

rebase-abort: ## abort a rebase: the tree, patches/ and the pins stay exactly as before
	$(AFD) rebase-abort $(if $(TO),--to $(TO)) $(TREE_ARGS)

rebase-report: ## try the series on every newer release -> docs/upstream-status.md (RELEASES="a b")
	$(AFD) rebase-report --out docs/upstream-status.md $(if $(RELEASES),--releases $(RELEASES))

drift: ## static check of overlay imports/calls against release X: make drift VLLM_VERSION=X
	$(if $(TO),,$(error usage: make drift VLLM_VERSION=X (or TO=X)))
	$(AFD) drift --to $(TO) $(REBASE_ARGS)

clean: ## remove build/ and dist/ (keeps .venv and the download cache)
	rm -rf build dist
