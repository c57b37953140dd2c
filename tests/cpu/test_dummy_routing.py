"""benchmarks/dummy_routing.py on the CPU: with vLLM's dummy weights a DeepSeek-V2 router's
softmax, taken in the logits' dtype (bf16) as vLLM's grouped top-k does on CUDA, rounds every
expert's score to one value, so the whole batch takes the same top-k experts; a float32
softmax of the same logits spreads the batch over more experts. docs/benchmarks.md ("Dummy
weights and MoE routing") says what this does to the GPU figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_e2e  # a real vLLM engine

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_dummy_weights_collapse_the_bf16_routing(models_dir, vllm_cpu_env, tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "dummy_routing.py"),
         "--model", str(models_dir / "deepseek_v2_mla"), "--device", "cpu",
         "--batch", "8", "--input-len", "8", "--steps", "3", "--json", str(out)],
        capture_output=True, text=True, env=vllm_cpu_env, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    calls = res["router_calls"]
    assert [c["tokens"] for c in calls] == [64, 8, 8]  # the prefill, then two decode steps
    for c in calls:
        assert c["dtype"] == "bfloat16" and c["max_abs_logit"] < 1e-3
        assert c["distinct_scores_token0"] == 1
        assert c["experts_native_softmax"] == res["top_k"]
        assert c["experts_fp32_softmax"] > res["top_k"]
    assert "MoE layers, 8 experts, top-2" in p.stdout
