"""benchmarks/serve.py: the OpenAI-API serving benchmark (``vllm bench serve`` against
real `vllm serve` processes) on the CPU, AFD 1A1F with the tiny checkpoint; and its
refusals of bad arguments."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE = REPO_ROOT / "benchmarks" / "serve.py"
MODEL = "qwen3_moe"


def run(args: list[str], env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SERVE), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.mark.cpu_e2e
def test_afd_serving_figures_come_from_every_request(model_dir, tmp_path, vllm_cpu_env):
    out = tmp_path / "serve.json"
    p = run(["--model", str(model_dir), "--modes", "afd", "--num-prompts", "4",
             "--warmups", "1", "--input-len", "8", "--output-len", "6",
             "--log-dir", str(tmp_path / "logs"), "--json", str(out)], env=vllm_cpu_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["mode"] == "afd"
    assert r["completed"] == 4
    assert r["total_output_tokens"] == 4 * 6  # ignore_eos: every token asked for
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"],
                                                   rel=1e-3)
    assert r["mean_tpot_ms"] > 0
    # The requests went through the AFD attention server, whose FFN rank served them.
    attn_log = (tmp_path / "logs" / "afd" / "afd_attention.log").read_text()
    assert "connected to FFN rank 0" in attn_log
    assert "POST /v1/completions" in attn_log
    assert "afd      " in p.stdout and "output" in p.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--modes", "plain,fast"], r"--modes: unknown \['fast'\]"),
        (["--modes", "plain_x2"], r"plain_x2 needs two GPUs"),
        (["--modes", "plain_x2", "--device", "cuda", "--ffn-gpu", "0"],
         r"plain_x2 needs two GPUs"),
        (["--output-len", "1"], r"--output-len at least 2"),
    ],
)
def test_bad_arguments_are_refused(args, message, tmp_path):
    p = run(["--model", str(tmp_path), *args], timeout=60)
    assert p.returncode == 2
    assert re.search(message, p.stderr), p.stderr


def test_a_missing_model_directory_is_refused(tmp_path):
    p = run(["--model", str(tmp_path / "nope")], timeout=60)
    assert p.returncode == 2 and "not a directory" in p.stderr
