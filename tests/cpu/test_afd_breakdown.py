"""benchmarks/decode.py --breakdown on the CPU: both roles' traces of the same decode steps
are recorded and parsed into the per-layer breakdown (benchmarks/breakdown.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.mark.parametrize("mode", ["afd", "afd_dbo"])
def test_decode_breakdown_of_profiled_steps(models_dir, tmp_path, mode):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "decode.py"),
           "--model", str(models_dir / "qwen3_moe"), "--batch", "4", "--input-len", "8",
           "--output-len", "8", "--repeats", "1", "--modes", mode, "--breakdown", str(STEPS),
           "--dbo-threshold", "2", "--json", str(out), "--timeout", "400"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    # The TPOT from the engine's own output steps (decode.decode_times): the one full-length
    # run's 7 step intervals, first to last token.
    (run,) = r["full_runs"]
    assert len(run["step_s"]) == 7 and min(run["step_s"]) > 0, run
    assert r["tpot_s"] == run["tpot_s"] == pytest.approx(sum(run["step_s"]) / 7, abs=1e-6)
    assert 0 < r["first_token_s"] < r["full_s"] - 7 * r["tpot_s"] + 1e-6
    bd = r["breakdown"]
    att, ffn, c = bd["attention"], bd["ffn"], bd["combined_us"]
    assert att["source"] == ffn["source"] == "host"
    # The attention's profiler ran STEPS steps: STEPS - 1 complete periods (one of slack
    # for where its first span falls); the FFN figures cover the same periods.
    assert STEPS - 2 <= att["steps"] <= STEPS - 1, att
    assert ffn["steps"] == att["steps"], ffn
    # qwen3_moe has 3 remote FFN layers (layer 0 dense included); with DBO each goes
    # once per micro-batch, from the micro-batch threads (recorded: all threads profiled)
    per_step = 3 * (2 if mode == "afd_dbo" else 1)
    assert att["layers_per_step"] == per_step and ffn["layers_per_step"] == per_step
    a, f = att["us_per_step"], ffn["us_per_step"]
    assert min(a["send"], a["wait"], a["attention"], f["compute"], f["send"]) > 0, bd
    # Both roles over the same wall-clock steps (one host, one time base).
    assert bd["same_windows"] and f["step"] == pytest.approx(a["step"])
    assert c["bound"] == pytest.approx(max(a["attention"], f["compute"]) + a["send"] + f["send"])
    assert "per-layer breakdown" in p.stdout and "over the bound" in p.stdout, p.stdout[-2000:]
    # The FFN rank's pass counters (decode.py reads them from its child at exit): one
    # attention rank, so no pass joins several, and every timed and profiled step was served.
    # No FFN graphs on the CPU.
    m = re.search(r"FFN passes (\d+), of them joining several attention ranks (\d+); rounds "
                  r"interleaving several ranks \(pingpong\) (\d+); FFN graphs captured (\d+), "
                  r"replayed (\d+) times", p.stdout)
    assert m, p.stdout[-2000:]
    assert int(m.group(1)) >= 8 + STEPS and m.groups()[1:] == ("0", "0", "0", "0")
