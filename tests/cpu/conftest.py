"""Shared fixtures for the CPU tests (real vLLM on the CPU, in the project venv)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import procs  # noqa: F401  (fixture: the afd_proc.py engines a test starts)

import serve_util as su

REPO_ROOT = Path(__file__).resolve().parents[2]

# vLLM's sampler holds torch.compile'd helpers (compiled_random_sample), which the engine's
# warm-up runs: on the CPU, TorchDynamo then has inductor probe the vector ISA by building
# test programs and loading each in a new Python process (torch._inductor.cpu_vec_isa),
# 12-16 s of every engine start here. Every engine these tests start is eager
# (enforce_eager), so the processes they start run with TorchDynamo off: the same code
# for plain vLLM and AFD, the sampler's helpers uncompiled. TORCHDYNAMO_DISABLE=0 in the
# environment keeps it on.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """build/models (or $AFD_MODELS_DIR), written by `make models`; fails loudly when absent."""
    path = Path(os.environ.get("AFD_MODELS_DIR") or REPO_ROOT / "build" / "models")
    if not path.is_dir():
        pytest.fail(f"{path} is missing: run `make models` first", pytrace=False)
    return path


@pytest.fixture
def vllm_cpu_env() -> dict[str, str]:
    """The environment of one small in-process vLLM engine on the CPU, for a test that runs
    a script itself (serve_util.engine_env: a VLLM_PORT base of its own for each test)."""
    return su.engine_env(in_process=True)


@pytest.fixture(scope="module")
def model_dir(request, models_dir) -> Path:
    """The checkpoint named by the test module's ``MODEL`` under ``models_dir``."""
    path = models_dir / request.module.MODEL
    assert (path / "model.safetensors").is_file(), f"{path}: run `make models`"
    return path
