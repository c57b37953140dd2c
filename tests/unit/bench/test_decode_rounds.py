"""--rounds of benchmarks/decode.py and benchmarks/serve.py: each mode's median run over
fresh engines, and the ratio to plain vLLM from the median runs (one H200's engines differed
by up to 10% in TPOT)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import decode  # benchmarks/decode.py
import pytest

DECODE = Path(decode.__file__)


def run(batch: int, mode: str, tpot_ms: float, rnd: int) -> dict:
    return {"batch": batch, "routing": "balanced", "mode": mode, "round": rnd,
            "tpot_s": tpot_ms / 1e3, "prefill_s": 0.1}  # fmt: skip


def test_medians_ranges_and_ratio_from_the_medians():
    # Three rounds at batch 16 (one slow AFD engine), one at batch 64.
    results = [run(16, "plain", t, i) for i, t in enumerate((9.57, 8.79, 9.25))]
    results += [run(16, "afd", t, i) for i, t in enumerate((8.87, 11.44, 9.48))]
    results += [run(64, "plain", 10.0, 0), run(64, "afd", 10.5, 0)]
    rows = decode.summarize(results, [16, 64], ["balanced"], ["plain", "afd"])
    assert [(r["batch"], r["mode"], r["runs"]) for r in rows] == [
        (16, "plain", 3), (16, "afd", 3), (64, "plain", 1), (64, "afd", 1)]
    plain16, afd16, plain64, afd64 = rows
    assert plain16["tpot_s"] == pytest.approx(9.25e-3)
    assert afd16["tpot_s"] == pytest.approx(9.48e-3)
    assert (afd16["tpot_min_s"], afd16["tpot_max_s"]) == pytest.approx((8.87e-3, 11.44e-3))
    # Throughput medians (batch / TPOT): the slow 11.44 ms engine does not pull AFD down.
    assert afd16["decode_tok_s"] == pytest.approx(16 / 9.48e-3)
    assert afd16["vs_plain"] == pytest.approx(9.25 / 9.48)
    assert plain16["vs_plain"] == pytest.approx(1.0)
    assert afd64["vs_plain"] == pytest.approx(10.0 / 10.5)
    assert plain64["tpot_min_s"] == plain64["tpot_max_s"] == pytest.approx(10e-3)


def test_of_an_even_number_of_runs_the_slower_middle_one():
    results = [run(8, "plain", t, i) for i, t in enumerate((5.0, 6.0, 7.0, 8.0))]
    (row,) = decode.summarize(results, [8], ["balanced"], ["plain"])
    assert row["tpot_s"] == pytest.approx(7.0e-3)  # not 6.5: a run that was measured
    assert row["decode_tok_s"] == pytest.approx(8 / 7.0e-3)


def test_without_plain_there_is_no_ratio():
    rows = decode.summarize([run(8, "afd", 5.0, 0)], [8], ["balanced"], ["afd"])
    assert rows[0]["vs_plain"] is None and rows[0]["runs"] == 1


@pytest.mark.parametrize("args, message", [
    (["--batches", "16,64,16"], "a batch size given twice (--rounds N measures each N times)"),
    (["--modes", "plain,afd,plain"], "a mode given twice"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])  # fmt: skip
def test_repeated_batches_or_modes_and_zero_rounds_are_refused(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(DECODE), "--model", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr


def test_serving_rounds_table_gives_median_runs_and_their_range(tmp_path, capsys):
    import serve as bench  # benchmarks/serve.py

    a = bench.parse_args(["--model", str(tmp_path), "--rounds", "3"])
    results = [{"mode": m, "round": i, "output_throughput": tput, "mean_tpot_ms": tpot,
                "mean_ttft_ms": 100.0}
               for m, runs in (("plain", ((5700.0, 10.2), (5750.0, 10.1), (5600.0, 10.4))),
                               ("afd", ((5650.0, 10.8), (5500.0, 11.0), (5800.0, 10.6))))
               for i, (tput, tpot) in enumerate(runs)]  # fmt: skip
    median = bench.median_runs(results, a.modes)
    assert median["plain"]["output_throughput"] == 5700.0
    assert median["afd"]["mean_tpot_ms"] == 10.8  # the median run's own TPOT
    bench.print_table(a, results)
    out = capsys.readouterr().out
    assert "[median of 3 rounds]" in out
    assert re.search(r"afd\s+5650\.0\s+0\.99x\s+10\.80\s+100\.0\s+\(5500\.0-5800\.0 tok/s\)", out), out


def test_rounds_alternate_the_modes_order():
    import serve_util as su

    assert su.rounds_of(["plain", "afd"], 3) == [
        (0, "plain"), (0, "afd"), (1, "afd"), (1, "plain"), (2, "plain"), (2, "afd")]
    assert su.rounds_of(["afd"], 1) == [(0, "afd")]
