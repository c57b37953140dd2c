"""--afd-config through vLLM's own argument parsing and config building."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_e2e  # vllm serve processes (they end at the parse)

VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _serve(model: Path, *args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run([*VLLM, "serve", str(model), *args], capture_output=True, text=True,
                       timeout=120)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


# One refusal of each kind through the real `vllm serve` (a bad value, a bad combination,
# text that is not JSON): every message AFDConfig gives, the unknown key and the port range
# among them, is tested on parse_afd_config_arg in tests/unit/afd/test_afd_config.py. Four
# processes, two at a time.
BAD_CONFIGS = [
    ('{"role": "bogus"}', "'role' must be one of attention, ffn"),
    ('{"role": "ffn", "num_attention_ranks": 3, "num_ffn_ranks": 2}', "must be a multiple"),
    ("not json", "not valid JSON"),
]


TWICE = ("--afd-config", '{"role": "ffn"}', "--additional-config", '{"afd": {"role": "ffn"}}')


@pytest.fixture(scope="module")
def refused_runs(models_dir) -> dict[tuple[str, ...], tuple[int, str, float]]:
    """`vllm serve` with each refused argument list (every BAD_CONFIGS entry, and AFD
    configured twice), two at a time: each process spends its life importing vLLM on
    one core."""
    cases = [("--afd-config", bad) for bad, _ in BAD_CONFIGS] + [TWICE]
    with ThreadPoolExecutor(2) as pool:
        runs = {args: pool.submit(_serve, models_dir / "llama", *args) for args in cases}
        return {args: run.result() for args, run in runs.items()}


@pytest.mark.parametrize("bad, message", BAD_CONFIGS)
def test_bad_afd_config_fails_at_parse(refused_runs, bad, message):
    rc, out, elapsed = refused_runs[("--afd-config", bad)]
    assert rc == 2, out[-2000:]
    assert message in out, out[-2000:]
    assert "AFD: connecting" not in out and "listening on" not in out
    assert elapsed < 60


def test_afd_config_and_additional_config_together_is_an_error(refused_runs):
    rc, out, _ = refused_runs[TWICE]
    assert rc != 0
    assert "AFD is configured twice" in out, out[-2000:]
    assert "listening on" not in out


_CONFIG_PROBE = """
import json, sys
from vllm.config.afd import AFDConfig
from vllm.engine.arg_utils import EngineArgs

def build(**kw):
    return EngineArgs(model=sys.argv[1], max_model_len=256, **kw).create_engine_config()

plain = build()
ffn = build(afd_config={"role": "ffn", "port": 29700})
attn = build(additional_config={"afd": {"role": "attention", "connector": "tcp"}})
print(json.dumps({
    "plain": plain.afd_config is None,
    "ffn": isinstance(ffn.afd_config, AFDConfig) and ffn.afd_config.is_ffn,
    "attn": attn.afd_config.is_attention and attn.afd_config.connector == "gloo",
    "hashes": [plain.compute_hash(), ffn.compute_hash(), attn.compute_hash()],
}))
"""


def test_engine_config_carries_afd_and_hashes_roles_apart(models_dir):
    # In a subprocess: building a VllmConfig mutates process-wide state.
    r = subprocess.run([sys.executable, "-c", _CONFIG_PROBE, str(models_dir / "llama")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["plain"] and got["ffn"] and got["attn"]
    assert len(set(got["hashes"])) == 3
