"""Shared fixtures for the CPU tests (real vLLM on the CPU, in the project venv)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# vLLM's sampler holds torch.compile'd helpers (compiled_random_sample), which the engine's
# warm-up runs: on the CPU, TorchDynamo then has inductor probe the vector ISA by building
# test programs and loading each in a new Python process (torch._inductor.cpu_vec_isa),
# 12-16 s of every engine start here. Every engine these tests start is eager
# (enforce_eager), so the processes they start run with TorchDynamo off: the same code
# for plain vLLM and AFD, the sampler's helpers uncompiled. TORCHDYNAMO_DISABLE=0 in the
# environment keeps it on.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Environment for a vLLM engine on this CPU machine: small KV cache, engine core in-process
# (faster start, one process per engine subprocess), no GPU-only sampler.
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """build/models (or $AFD_MODELS_DIR), written by `make models`; fails loudly when absent."""
    path = Path(os.environ.get("AFD_MODELS_DIR") or REPO_ROOT / "build" / "models")
    if not path.is_dir():
        pytest.fail(f"{path} is missing: run `make models` first", pytrace=False)
    return path


@pytest.fixture(scope="session")
def vllm_cpu_env() -> dict[str, str]:
    """os.environ plus the settings for a small in-process vLLM engine on the CPU."""
    return {**os.environ, **VLLM_CPU_ENV}


@pytest.fixture(scope="module")
def model_dir(request, models_dir) -> Path:
    """The checkpoint named by the test module's ``MODEL`` under ``models_dir``."""
    path = models_dir / request.module.MODEL
    assert (path / "model.safetensors").is_file(), f"{path}: run `make models`"
    return path
