"""benchmarks/serve.py: its refusals of bad arguments. Its client half runs against a real
AFD pair in tests/cpu/test_afd_serve.py (the servers are those of serve_util, which that
module starts and stops)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVE = REPO_ROOT / "benchmarks" / "serve.py"


def run(args: list[str], env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SERVE), *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--modes", "plain,fast"], r"--modes: unknown \['fast'\]"),
        (["--modes", "plain_x2"], r"plain_x2 needs two GPUs"),
        (["--modes", "plain_x2", "--device", "cuda", "--ffn-gpu", "0"],
         r"plain_x2 needs two GPUs"),
        (["--output-len", "1"], r"--output-len at least 2"),
        (["--warmups", "-1"], r"--warmups must be at least 0"),
        (["--rounds", "0"], r"--rounds must be at least 1"),
        (["--modes", "plain,afd,plain"], r"a mode given twice"),
    ],
)
def test_bad_arguments_are_refused(args, message, tmp_path):
    p = run(["--model", str(tmp_path), *args], timeout=60)
    assert p.returncode == 2
    assert re.search(message, p.stderr), p.stderr


def test_a_missing_model_directory_is_refused(tmp_path):
    p = run(["--model", str(tmp_path / "nope")], timeout=60)
    assert p.returncode == 2 and "not a directory" in p.stderr


def test_warmups_default_to_the_measured_request_count(tmp_path):
    """The warm-up sends as many requests as the measured run (at once), so it meets the
    run's batch sizes; an explicit count is kept."""
    import serve as bench  # benchmarks/serve.py

    base = ["--model", str(tmp_path), "--num-prompts", "12"]
    assert bench.parse_args(base).warmups == 12
    assert bench.parse_args([*base, "--warmups", "0"]).warmups == 0
    cmd = bench.bench_command(bench.parse_args(base), "http://x", tmp_path, "r")
    assert cmd[cmd.index("--num-warmups") + 1] == "12"
    assert cmd[cmd.index("--max-concurrency") + 1] == "12"


def test_balanced_routing_reaches_every_server(tmp_path):
    """--routing balanced: plain and both AFD roles get the benchmark routing strategy (and
    their GPUs on CUDA); the default clears it, so the checkpoint's router runs."""
    import serve as bench  # benchmarks/serve.py

    import serve_util as su

    base = ["--model", str(tmp_path)]
    assert bench.server_env(bench.parse_args(base), "0", None) == {su.ROUTING_ENV: ""}
    a = bench.parse_args([*base, "--routing", "balanced"])
    assert bench.server_env(a, "0", None) == {su.ROUTING_ENV: "afd_balanced"}
    a = bench.parse_args([*base, "--routing", "balanced", "--device", "cuda",
                          "--connector", "cuda_ipc"])
    env = bench.server_env(a, "1", "0")
    assert env[su.ROUTING_ENV] == "afd_balanced" and env["CUDA_VISIBLE_DEVICES"] == "1,0"
    p = run([*base, "--routing", "skewed"], timeout=60)
    assert p.returncode == 2 and "--routing" in p.stderr
