# vLLM-AFD: the single entry point. `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3
AFD := PYTHONPATH=$(CURDIR)/scripts $(PY) -m afdtool
# Upstream target: `make X VLLM_VERSION=V` (or TO=V) works on targets/V/ (pin, patches); without
# it the primary pin (file VLLM_VERSION). Only a command-line VLLM_VERSION counts (an environment
# variable of that name is ignored). afdtool resolves the target once (scripts/afdtool/targets.py:
# pin, patches, tree build/vllm[-V], venv .venv[-V], models build/models[-V], revision); every
# afdtool command gets --target, and the venv and models paths below come from it.
ifeq ($(origin VLLM_VERSION),command line)
TO := $(VLLM_VERSION)
endif
TARGET_ARGS = $(if $(TO),--target $(TO))
# the rebase commands start from the newest carried target unless FROM=Y names one
FROM_ARGS = $(if $(FROM),--target $(FROM))
# A target's own paths (`afdtool target --field`); an unknown target leaves them empty and its
# afdtool command then says what to do.
target_field = $(shell $(AFD) target $(TARGET_ARGS) --field $(1) 2>/dev/null)
ifeq ($(origin VENV),undefined)
VENV := $(call target_field,venv)
endif
ifeq ($(origin MODELS),undefined)
MODELS := $(call target_field,models)
endif
VPY := $(abspath $(VENV))/bin/python
PYTEST_ARGS ?=
REBASE_ARGS ?=
TREE_ARGS = $(if $(TREE),--tree $(TREE))

.DEFAULT_GOAL := help
.PHONY: help fetch apply-patches export-patches check wheel wheel-cpu venv models bundle \
        models-table status-page demo test test-unit test-cpu test-oracle test-target test-gpu lint clean \
        rebase rebase-continue rebase-abort rebase-report drift

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

fetch: ## download (or reuse from cache) the pinned sdist and wheels, sha256-checked (FETCH_ARGS="--source DIR")
	$(AFD) fetch all $(TARGET_ARGS) $(FETCH_ARGS)

apply-patches: ## pinned vLLM source + overlay + patches/series -> build/vllm (git repo) (APPLY_ARGS="--force", "--source X")
	$(AFD) apply $(TARGET_ARGS) $(APPLY_ARGS)

export-patches: ## commits after the overlay commit in build/vllm -> patches/ and overlay/ (EXPORT_ARGS=--patches-only)
	$(AFD) export $(TARGET_ARGS) $(EXPORT_ARGS)

check: ## series applies strictly, re-export byte-identical, headers, prefixes compile; generated docs current
	$(AFD) check $(TARGET_ARGS) $(CHECK_ARGS)
	$(AFD) rebase-report --verify --out docs/upstream-status.md
	$(PY) scripts/models_table.py --check
	$(PY) scripts/status_page.py --check

wheel: apply-patches ## custom CUDA wheel -> dist/vllm-X+afd.<rev>-cp38-abi3-manylinux_2_28_x86_64.whl
	$(AFD) wheel --variant cuda $(TARGET_ARGS)

wheel-cpu: apply-patches ## custom CPU wheel -> dist/vllm-X+afd.<rev>.cpu-...whl
	$(AFD) wheel --variant cpu $(TARGET_ARGS)

venv: wheel-cpu ## .venv with torch and the custom CPU wheel (no-op when up to date)
	$(AFD) venv --venv $(VENV) $(TARGET_ARGS)

models: venv ## tiny deterministic random-weight checkpoints -> build/models/ (build/models-X)
	$(VPY) scripts/make_models.py --out $(MODELS)

models-table: ## docs/models.md: the supported model families table from vllm.afd.architectures
	$(PY) scripts/models_table.py

status-page: ## docs/status.md and the connector matrix of docs/connectors.md from the spec records, the lines and docs/results/*.json
	$(PY) scripts/status_page.py

bundle: wheel ## offline install bundle for the GPU host -> dist/bundle/ (parts <= 48 MiB)
	$(AFD) bundle $(TARGET_ARGS)

demo: models ## CPU: AFD (1 attention + 1 FFN server) vs plain vLLM, prints MATCH/MISMATCH
	$(VPY) scripts/demo.py --model $(MODELS)/qwen3_moe

# The unit tests run in the venv (torch, vLLM) against overlay/ as it is in the tree
# (tests/conftest.py); test_real_wheel and test_real_pinned_series need the upstream wheels
# and the sdist in the cache (`fetch`) and build/vllm (`venv` builds it).
test-unit: fetch venv ## unit tests in the venv: tooling and AFD logic (overlay/ as in the tree)
	$(VPY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-cpu: models ## real vLLM on the CPU: plain checkpoints and the AFD oracle
	AFD_MODELS_DIR=$(abspath $(MODELS)) $(VPY) -m pytest -q tests/cpu $(PYTEST_ARGS)

# The unit tests (about two minutes on one core) run beside the CPU tests, whose engines
# leave a core idle while they start, wait or restart; their output follows the CPU tests'.
# Each of the two pytest runs hands out listen ports from its own part of the window
# (AFD_PORT_WINDOW, scripts/serve_util/ports.py): the CPU tests below TEST_PORT_SPLIT, the unit
# tests from it up (serve_util clips the top at the kernel's ephemeral range).
TEST_PORT_SPLIT = 31500
test: fetch models ## everything CI runs: lint, make check, unit and CPU tests
	$(MAKE) lint
	$(MAKE) check
	@unit_log=$$(mktemp); \
	AFD_PORT_WINDOW=$(TEST_PORT_SPLIT)-65536 $(VPY) -m pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS) \
		> "$$unit_log" 2>&1 & unit=$$!; \
	AFD_PORT_WINDOW=30100-$(TEST_PORT_SPLIT) AFD_MODELS_DIR=$(abspath $(MODELS)) \
		$(VPY) -m pytest -q --durations=30 tests/cpu $(PYTEST_ARGS); \
	cpu_rc=$$?; wait $$unit; unit_rc=$$?; \
	echo "--- tests/unit (ran beside tests/cpu): exit $$unit_rc"; cat "$$unit_log"; rm -f "$$unit_log"; \
	echo "tests/cpu: exit $$cpu_rc, tests/unit: exit $$unit_rc"; \
	[ $$cpu_rc -eq 0 ] && [ $$unit_rc -eq 0 ]

test-oracle: models ## the CPU oracle alone (AFD == plain vLLM); per target: VLLM_VERSION=X
	AFD_MODELS_DIR=$(abspath $(MODELS)) $(VPY) -m pytest -q tests/cpu/test_afd_oracle.py $(PYTEST_ARGS)

# The per-line CPU check of the other lines: the oracle file and a `vllm serve` pair, without
# the tests marked `primary_pin` (pyproject.toml; each says why it runs on the primary pin
# only in CI; `make test-oracle VLLM_VERSION=X` runs them on line X).
test-target: models ## per-target CPU runtime check: oracle, vllm serve pair, metrics and profiling
	AFD_MODELS_DIR=$(abspath $(MODELS)) $(VPY) -m pytest -q --durations=15 tests/cpu/test_afd_oracle.py \
		tests/cpu/test_afd_serve.py -m "not primary_pin" $(PYTEST_ARGS)

test-gpu: ## GPU tests (run on the GPU host): pytest -m gpu
	$(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

lint: ## ruff over scripts, tests, overlay, benchmarks
	$(VPY) -m ruff check scripts tests overlay benchmarks

rebase: ## carry the series to release X (from the newest carried target; FROM=Y, TREE=dir, REBASE_ARGS=--drop-empty|--full-hunks)
	$(if $(TO),,$(error usage: make rebase VLLM_VERSION=X (or TO=X)))
	$(AFD) rebase --to $(TO) $(FROM_ARGS) $(TREE_ARGS) $(REBASE_ARGS)

rebase-continue: ## resume a stopped rebase after `git add` (REBASE_ARGS=--skip drops the patch)
	$(AFD) rebase-continue $(if $(TO),--to $(TO)) $(TREE_ARGS) $(REBASE_ARGS)

rebase-abort: ## abort a rebase: the tree, patches/ and the pins stay exactly as before
	$(AFD) rebase-abort $(if $(TO),--to $(TO)) $(TREE_ARGS)

rebase-report: ## each release newer than the pin, tried with the series of the newest carried line older than it (FROM=Y: that line's for all) -> docs/upstream-status.md (incremental; RELEASES="a b")
	$(AFD) rebase-report $(FROM_ARGS) --out docs/upstream-status.md $(if $(RELEASES),--releases $(RELEASES))

drift: ## static check of overlay imports/calls against release X: make drift VLLM_VERSION=X
	$(if $(TO),,$(error usage: make drift VLLM_VERSION=X (or TO=X)))
	$(AFD) drift --to $(TO) $(FROM_ARGS) $(REBASE_ARGS)

clean: ## remove build/ and dist/ (keeps .venv and the download cache)
	rm -rf build dist
