"""GPU oracle: plain vLLM vs AFD on the same random-weight checkpoint (bf16).

Run on the GPU host after installing the offline bundle (scripts/gpu/run_gpu.sh):
    python3 -m pytest -m gpu tests/gpu

With one GPU both roles share it and use the `gloo` (TCP) connector, which
stages activations through host memory; with two GPUs a second case puts the
FFN rank on GPU 1 with the `nccl` connector. The attention role runs eager
(CUDA graphs with AFD are not supported yet). Greedy tokens must be identical
and top-5 logprobs within BF16_TOL.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "afd_cpu_oracle", HERE.parent / "cpu" / "test_afd_oracle.py"
)
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

BF16_TOL = 0.05
MODELS_DIR = Path(os.environ.get("AFD_MODELS_DIR", HERE.parents[1] / "build" / "models"))
GPU_ARGS = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "4"]


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        p.stop()


def _env(model: Path, gpu: int) -> dict:
    env = oracle.env_for(model)
    env.pop("VLLM_MLA_DISABLE", None)  # MLA on the GPU
    env.update(CUDA_VISIBLE_DEVICES=str(gpu), VLLM_USE_FLASHINFER_SAMPLER="0")
    return env


def _proc(args, model, log, gpu, procs):
    p = oracle.Proc.__new__(oracle.Proc)
    p.log = log
    p.fh = open(log, "w")
    import subprocess
    import sys

    p.p = subprocess.Popen(
        [sys.executable, str(oracle.PROC), *args, "--model", str(model), *GPU_ARGS],
        stdout=p.fh, stderr=subprocess.STDOUT, env=_env(model, gpu), start_new_session=True,
    )
    procs.append(p)
    return p


def _compare(plain: dict, afd: dict) -> float:
    worst = 0.0
    for i, (a, b) in enumerate(zip(plain["outputs"], afd["outputs"])):
        assert a["token_ids"] == b["token_ids"], f"prompt {i}: tokens differ"
        for la, lb in zip(a["logprobs"], b["logprobs"]):
            for tok, lp in la.items():
                assert tok in lb
                worst = max(worst, abs(lp - lb[tok]))
    assert worst <= BF16_TOL, worst
    return worst


CASES = [("gloo", 0)]
if torch.cuda.device_count() >= 2:
    CASES.append(("nccl", 1))


@pytest.mark.parametrize("connector,ffn_gpu", CASES)
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2_mla"])
def test_gpu_oracle_1a1f(name, connector, ffn_gpu, tmp_path, procs):
    model = MODELS_DIR / name
    prompts = oracle.write_prompts(tmp_path)
    plain = _proc(["plain", "--prompts", str(prompts), "--out", str(tmp_path / "plain.json")],
                  model, tmp_path / "plain.log", 0, procs)
    assert plain.wait(oracle.START_TIMEOUT) == 0, plain.tail()
    port = oracle.free_port(3)
    ffn = _proc(["ffn", "--afd", oracle.afd_json("ffn", port, connector=connector)],
                model, tmp_path / "ffn.log", ffn_gpu, procs)
    attn = _proc(["attention", "--afd", oracle.afd_json("attention", port, connector=connector),
                  "--prompts", str(prompts), "--out", str(tmp_path / "afd.json")],
                 model, tmp_path / "attn.log", 0, procs)
    assert attn.wait(oracle.START_TIMEOUT) == 0, attn.tail() + "\n--- ffn ---\n" + ffn.tail()
    worst = _compare(json.loads((tmp_path / "plain.json").read_text()),
                     json.loads((tmp_path / "afd.json").read_text()))
    print(f"{name} {connector}: tokens identical, max |logprob diff| {worst:.3g}")
