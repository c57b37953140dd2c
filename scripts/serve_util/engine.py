"""What an engine is started with: the `vllm serve` command line, the ``--afd-config``
object, the devices, the MoE routing and the environment of every engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from serve_util.ports import internal_port_base

# Flags for every server on the small CPU machine (no prefix caching: both sides of a
# comparison must compute every token).
CPU_SERVE_ARGS = [
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
    "--no-enable-prefix-caching",
    "--seed", "0",
]  # fmt: skip


# Environment for every vLLM engine these tools and tests start: a small KV cache on the CPU
# (1 GiB; ignored on CUDA), no FlashInfer sampler, no tokenizer thread pool. See engine_env.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


CPU_SERVE_ENV = ENGINE_ENV  # the name benchmarks and older callers know


def afd_config(role: str, port: int, *, timeout_s: float = 120.0, host: str = "127.0.0.1",
               connector: str = "gloo", num_attention_ranks: int = 1, num_ffn_ranks: int = 1,
               **extra: Any) -> dict[str, Any]:
    """The ``--afd-config`` object of one side of an AFD deployment."""
    return {
        "role": role,
        "connector": connector,
        "host": host,
        "port": port,
        "num_attention_ranks": num_attention_ranks,
        "num_ffn_ranks": num_ffn_ranks,
        "timeout_s": timeout_s,
        **extra,
    }


def cuda_visible_devices(own: str, peer: str | None = None, connector: str = "") -> str:
    """CUDA_VISIBLE_DEVICES of a process on GPU ``own``: that GPU as device 0, and for an
    AFD role with the cuda_ipc connector also its peer's GPU (each side maps the other's
    memory). ``peer`` None: a plain engine."""
    if peer is not None and peer != own and connector in ("cuda_ipc", "ipc"):
        return f"{own},{peer}"
    return own


def shared_gpu_note(device: str, modes: list[str], attention_gpu: str, ffn_gpu: str,
                    mps: bool = False) -> str | None:
    """The note for AFD modes whose two roles share one GPU, or None; it says which of the
    two ways the GPU is shared. Without MPS two processes on one GPU time-slice it (one
    context runs at a time) and a role waiting for its peer holds its slice: measured on one
    H200 (2026-12-02), 2.2 ms per hand-over, AFD at 0.04x plain - a functional check, not a
    figure of AFD. Under CUDA MPS (``--mps``) both roles' kernels run at once and share the
    GPU's SMs and memory bandwidth."""
    if device != "cuda" or attention_gpu != ffn_gpu or not any(m.startswith("afd") for m in modes):
        return None
    if mps:
        return (f"note: both AFD roles on GPU {attention_gpu} under CUDA MPS: their kernels run "
                "at once and share the GPU's SMs and memory bandwidth, so the figures show "
                "AFD's overheads against plain vLLM on the same GPU, not a two-GPU deployment")
    return (f"note: both AFD roles on GPU {attention_gpu} without MPS: the two processes "
            "time-slice it and every layer's hand-over waits for a time slice, so the AFD "
            "figures measure the sharing, not AFD (docs/gpu-tests.md, \"One GPU or two\"); "
            "use --mps, or give the FFN rank its own GPU with --ffn-gpu")


ROUTING_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"


def routing_env(routing: str) -> dict[str, str]:
    """The environment of an engine for a benchmark's MoE routing: ``balanced`` the project's
    ``afd_balanced`` strategy (vllm/afd/routing.py), ``model`` the checkpoint's router (an
    empty strategy, which also overrides one this process inherited)."""
    if routing not in ("model", "balanced"):
        raise ValueError(f"unknown routing {routing!r}: 'model' or 'balanced'")
    return {ROUTING_ENV: "afd_balanced" if routing == "balanced" else ""}


def dummy_routing_note(load_format: str, routings: list[str]) -> str | None:
    """The warning for dummy weights with the checkpoint's MoE router, or None. vLLM's dummy
    weights make DeepSeek-V2's router logits about 1e-5; its bf16 softmax then gives every
    expert the same score and the whole batch takes the same top-k experts (measured on an
    H200 on 2026-12-03: 6 of 64), so the MoE reads a tenth of a trained model's weights."""
    if load_format != "dummy" or "model" not in routings:
        return None
    return ("note: dummy weights with the model's router: a MoE model may route every token "
            "to the same experts (DeepSeek-V2: 6 of 64), so its MoE reads a fraction of the "
            "weights a trained model reads (docs/benchmarks.md, \"Dummy weights and MoE "
            "routing\"); --routing balanced spreads the tokens over all experts")


def vllm_python(python: str | None = None) -> str:
    """The interpreter that runs ``vllm``: ``python`` or this one."""
    return python or sys.executable


# `vllm` CLI for an interpreter whose vLLM is installed as the upstream `vllm-cpu`
# distribution: vllm.entrypoints.cli.main reads importlib.metadata.version("vllm") and fails
# there (vllm.platforms already falls back to "vllm-cpu"); map the name, then run the CLI.
_CLI_SHIM = (
    "import importlib.metadata as m, sys\n"
    "_v = m.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return _v(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _v('vllm-cpu') + '+cpu'\n"
    "m.version = version\n"
    "sys.argv[0] = 'vllm'\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.exit(main())\n"
)


_CLI_PREFIX: dict[str, list[str]] = {}


def vllm_cli(python: str | None = None) -> list[str]:
    """argv prefix that runs the ``vllm`` CLI with ``python``: ``PY -m
    vllm.entrypoints.cli.main`` when the interpreter has a ``vllm`` distribution, else
    ``PY -c SHIM`` (see _CLI_SHIM). Probed once per interpreter (no vLLM import)."""
    py = vllm_python(python)
    if py not in _CLI_PREFIX:
        probe = subprocess.run(
            [py, "-c", "import importlib.metadata as m; m.version('vllm')"],
            capture_output=True, timeout=60,
        )
        _CLI_PREFIX[py] = ([py, "-m", "vllm.entrypoints.cli.main"] if probe.returncode == 0
                           else [py, "-c", _CLI_SHIM])
    return list(_CLI_PREFIX[py])


def serve_command(model: str | os.PathLike, port: int, *, python: str | None = None,
                  afd: dict[str, Any] | None = None, host: str = "127.0.0.1",
                  extra_args: list[str] | None = None, cpu_args: bool = True) -> list[str]:
    """argv of ``vllm serve MODEL`` run by ``python`` (see :func:`vllm_cli`)."""
    cmd = [*vllm_cli(python), "serve", str(model), "--host", host, "--port", str(port)]
    if cpu_args:
        cmd += CPU_SERVE_ARGS
    if afd is not None:
        cmd += ["--afd-config", json.dumps(afd)]
    cmd += list(extra_args or [])
    return cmd


def mla_disabled(model: str | os.PathLike) -> bool:
    """True for a DeepSeek checkpoint (by its directory name): vLLM's CPU backend has no MLA
    attention, so such a model runs there with VLLM_MLA_DISABLE=1."""
    return "deepseek" in Path(model).name


def engine_env(cpu_model: str | os.PathLike | None = None, *, in_process: bool = False,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one vLLM engine process (a ``vllm serve`` server, or an offline
    engine of the tests' ``afd_proc.py``): os.environ, ENGINE_ENV, then

    * ``cpu_model``: the checkpoint of an engine on the CPU; a DeepSeek one gets
      VLLM_MLA_DISABLE=1 (:func:`mla_disabled`). None for a GPU engine, or where the caller
      sets it;
    * ``in_process``: VLLM_ENABLE_V1_MULTIPROCESSING=0, the engine core in the process that
      creates the engine (one process per engine: faster start, and the FFN serve loop of
      ``afd_proc.py ffn`` is in the process that watches it);
    * ``extra`` (wins over everything above);
    * VLLM_PORT: a base of its own (:func:`internal_port_base`) unless ``extra`` gives one,
      so that engines started together never share their internal ports.
    """
    env = {**os.environ, **ENGINE_ENV}
    if cpu_model is not None and mla_disabled(cpu_model):
        env["VLLM_MLA_DISABLE"] = "1"
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra or {})
    if "VLLM_PORT" not in (extra or {}):
        env["VLLM_PORT"] = str(internal_port_base())
    return env
