# vLLM-AFD: the single entry point. `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3
AFD := PYTHONPATH=$(CURDIR)/scripts $(PY) -m afdtool
VENV ?= .venv
VPY := $(CURDIR)/$(VENV)/bin/python
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help fetch apply-patches export-patches check wheel wheel-cpu venv models bundle \
        demo test test-unit test-cpu test-gpu lint clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

fetch: ## download (or reuse from cache) the pinned sdist and wheels, sha256-checked
	$(AFD) fetch all

apply-patches: ## pinned vLLM source + overlay + patches/series -> build/vllm (git repo)
	$(AFD) apply

export-patches: ## commits after the overlay commit in build/vllm -> patches/ and overlay/
	$(AFD) export

check: ## series applies strictly, re-export is byte-identical, headers present, prefixes compile
	$(AFD) check

wheel: apply-patches ## custom CUDA wheel -> dist/vllm-X+afd.<rev>-cp38-abi3-manylinux_2_28_x86_64.whl
	$(AFD) wheel --variant cuda

wheel-cpu: apply-patches ## custom CPU wheel -> dist/vllm-X+afd.<rev>.cpu-...whl
	$(AFD) wheel --variant cpu

venv: wheel-cpu ## .venv with torch and the custom CPU wheel (no-op when up to date)
	$(AFD) venv --venv $(VENV)

models: venv ## tiny deterministic random-weight checkpoints -> build/models/
	$(VPY) scripts/make_models.py --out build/models

bundle: wheel ## offline install bundle for the GPU host -> dist/bundle/ (parts <= 48 MiB)
	$(AFD) bundle

demo: models ## CPU: AFD (1 attention + 1 FFN server) vs plain vLLM, prints MATCH/MISMATCH
	$(VPY) scripts/demo.py --model build/models/qwen3_moe

test-unit: ## fast tests: tooling and AFD logic (no vLLM runtime)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-cpu: models ## real vLLM on the CPU: plain checkpoints and the AFD oracle
	$(VPY) -m pytest -q tests/cpu $(PYTEST_ARGS)

test: models ## everything CI runs: lint, make check, unit and CPU tests
	$(MAKE) lint
	$(MAKE) check
	$(VPY) -m pytest -q tests/unit tests/cpu $(PYTEST_ARGS)

test-gpu: ## GPU tests (run on the GPU host): pytest -m gpu
	$(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

lint: ## ruff over scripts, tests, overlay
	$(VPY) -m ruff check scripts tests overlay benchmarks

clean: ## remove build/ and dist/ (keeps .venv and the download cache)
	rm -rf build dist
