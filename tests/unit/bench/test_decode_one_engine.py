"""benchmarks/decode.py --engines M: the one plain engine of M x b (``plain_one``) beside the
M replicas and MA1F, and the roofline printed beside every figure."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import decode  # benchmarks/decode.py
import pytest

import serve_util as su
from vllm.afd import plan

DECODE = Path(decode.__file__)


def args(*argv: str) -> argparse.Namespace:
    p = decode.build_parser()
    a = p.parse_args(["--model", "deepseek-v2-lite", *argv])
    decode.check_sweep(p, a)
    return a


def test_default_modes_with_several_engines_include_the_one_engine():
    assert args().modes == "plain,afd"
    a = args("--engines", "2")
    assert a.modes == "plain,plain_one,afd"
    assert decode.check_sweep(decode.build_parser(), a)[2] == ["plain", "plain_one", "afd"]


def test_every_afd_mode_runs_once_per_ffn_schedule():
    a = args("--engines", "2", "--modes", "plain,plain_one,afd,afd_dbo",
             "--ffn-schedule", "join,pingpong", "--connector-extra", '{"ffn_hot_poll": false}')
    modes = decode.check_sweep(decode.build_parser(), a)[2]
    assert modes == ["plain", "plain_one", "afd", "afd_pingpong", "afd_dbo", "afd_dbo_pingpong"]
    assert [decode.split_mode(m) for m in modes[2:]] == [
        ("afd", "join"), ("afd", "pingpong"), ("afd_dbo", "join"), ("afd_dbo", "pingpong")]
    assert su.schedule_extra(a.connector_extra, "afd") == {"ffn_hot_poll": False}
    assert su.schedule_extra(a.connector_extra, "afd_dbo_pingpong") == {
        "ffn_hot_poll": False, "ffn_schedule": "pingpong"}
    assert decode.check_sweep(decode.build_parser(), args("--ffn-schedule", "pingpong"))[2] \
        == ["plain", "afd_pingpong"]
    assert decode.split_mode("afd_auto") == ("afd", "auto")
    # the benchmark's schedules are the configuration's
    from vllm.afd.connector_spec import FFN_SCHEDULES
    assert su.FFN_SCHEDULES == FFN_SCHEDULES


def test_the_ffn_line_counts_joined_passes_and_interleaved_rounds():
    line = decode.ffn_line({"steps_served": 300, "batched_steps": 0, "pingpong_steps": 280,
                            "graphs": 4, "graph_replays": 290})
    assert line == ("FFN passes 300, of them joining several attention ranks 0; rounds "
                    "interleaving several ranks (pingpong) 280; FFN graphs captured 4, "
                    "replayed 290 times")
    # an FFN rank on a plane the host drives (nixl) replays graphs of single layers
    nixl = {"steps_served": 60, "batched_steps": 0, "pingpong_steps": 0, "graphs": 0,
            "graph_replays": 0, "layer_graphs": 54, "layer_graph_replays": 1458}
    assert decode.ffn_line(nixl).endswith(
        "FFN graphs captured 0, replayed 0 times; layer graphs captured 54, replayed 1458 times"
    )


def test_plain_one_is_one_engine_of_all_the_sequences_and_their_kv_cache():
    a = args("--engines", "3", "--kv-cache-memory-bytes", "1000")
    common = decode.common_args(a)
    assert (decode.engines_of(a, "plain_one"), decode.engine_batch(a, "plain_one", 64)) == (1, 192)
    one = decode.mode_args(a, common, "plain_one", 64)
    assert one[one.index("--batch") + 1] == "192"
    assert one[one.index("--kv-cache-memory-bytes") + 1] == "3000"
    for mode in ("plain", "afd"):
        assert (decode.engines_of(a, mode), decode.engine_batch(a, mode, 64)) == (3, 64)
        other = decode.mode_args(a, common, mode, 64)
        assert other[other.index("--batch") + 1] == "64"
        assert other[other.index("--kv-cache-memory-bytes") + 1] == "1000"


def test_throughput_counts_each_engines_own_batch():
    """One engine of 192 sequences: 192 tokens a step; three of 64: 64 each, added up."""
    one = decode.combine([{"tpot_s": 0.008, "device": "cpu"}], 192)
    assert one["decode_tok_s"] == pytest.approx(192 / 0.008)
    many = decode.combine([{"tpot_s": 0.010, "itl_median_s": 0.0, "tpot_diff_s": 0.0,
                            "prefill_s": 0.0, "full_s": 0.0, "device": "cpu"}] * 3, 64)
    assert many["decode_tok_s"] == pytest.approx(3 * 64 / 0.010)


def test_summary_ratios_against_the_replicas_and_the_one_engine():
    # the one-H100 figures at a total concurrency of 128 (2 x 64)
    results = [
        {"batch": 64, "routing": "balanced", "mode": "plain", "round": 0, "tpot_s": 12.12e-3,
         "decode_tok_s": 10_560.0},
        {"batch": 64, "routing": "balanced", "mode": "plain_one", "round": 0,
         "tpot_s": 7.09e-3, "decode_tok_s": 18_061.0},
        {"batch": 64, "routing": "balanced", "mode": "afd", "round": 0, "tpot_s": 8.23e-3,
         "decode_tok_s": 15_561.0},
    ]
    rows = {r["mode"]: r for r in decode.summarize(results, [64], ["balanced"],
                                                    ["plain", "plain_one", "afd"])}
    assert rows["afd"]["vs_plain"] == pytest.approx(15_561 / 10_560)
    assert rows["afd"]["vs_one"] == pytest.approx(0.862, abs=0.001)
    assert rows["plain"]["vs_one"] == pytest.approx(0.585, abs=0.001)
    assert rows["plain_one"]["vs_one"] == pytest.approx(1.0)
    without = decode.summarize(results[::2], [64], ["balanced"], ["plain", "afd"])
    assert all(r["vs_one"] is None for r in without)


def test_graphs_cover_a_batch_over_512():
    assert decode.graph_sizes_for({}, 256) == {}
    assert decode.graph_sizes_for({"cudagraph_mode": "FULL_DECODE_ONLY"}, 768) == {
        "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 768}
    given = {"cudagraph_capture_sizes": [64]}
    assert decode.graph_sizes_for(given, 768) is given  # the user's sizes stand
    a = args("--engines", "3", "--batch", "256", "--compilation-config",
             '{"cudagraph_mode": "FULL_DECODE_ONLY"}')
    a.batch = 768  # the plain_one engine's
    assert decode.engine_kwargs(a)["compilation_config"]["max_cudagraph_capture_size"] == 768
    a = args("--batch", "768")  # eager: no graphs to size
    assert "compilation_config" not in decode.engine_kwargs(a)


def config_dir(tmp_path: Path, name: str = "deepseek-v2-lite", **over) -> Path:
    d = tmp_path / "shape"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**plan.PRESETS[name], **over}))
    return d


def test_bounds_beside_each_figure(tmp_path):
    model_dir = config_dir(tmp_path, num_hidden_layers=14)
    p = decode.build_parser()
    a = p.parse_args(["--model", str(model_dir), "--engines", "2", "--device", "cuda",
                      "--attention-gpu", "0", "--ffn-gpu", "0", "--input-len", "64",
                      "--output-len", "96", "--dtype", "bfloat16"])
    decode.check_sweep(p, a)
    model, why = decode.roofline_model(a)
    assert model is not None and model.layers == 14, why
    card, why = decode.roofline_card(a, [{"device": "NVIDIA H100 80GB HBM3"}])
    assert card is plan.CARDS["h100"], why
    rows = [{"batch": 64, "routing": "balanced", "mode": m, "tpot_s": t}
            for m, t in (("plain", 12.12e-3), ("plain_one", 7.09e-3), ("afd", 8.23e-3),
                         ("afd_pingpong", 10e-3), ("afd_auto", 9e-3))]
    decode.add_bounds(a, rows, model, card)
    assert "bound_s" not in rows.pop()  # auto: joined and interleaved rounds, no one bound
    by = {r["mode"]: r for r in rows}
    for mode, r in by.items():  # afd_pingpong: the FFN's weights read once per rank
        b = plan.step_bound(model, card, mode, 2, 64, 64 + 48, "balanced")
        assert r["bound_s"] == pytest.approx(b.step_s)
        assert r["of_bound"] == pytest.approx(b.step_s / r["tpot_s"])
        assert r["bound_tok_s"] == pytest.approx(128 / b.step_s)
    assert by["plain_one"]["of_bound"] == pytest.approx(0.686, abs=0.01)
    assert by["afd"]["of_bound"] == pytest.approx(0.620, abs=0.01)
    # the FFN rank on its own GPU: the busier GPU bounds the AFD step
    a.ffn_gpu = "1"
    decode.add_bounds(a, rows, model, card)
    assert rows[2]["bound_s"] == pytest.approx(
        plan.step_bound(model, card, "afd", 2, 64, 112, "balanced", same_gpu=False).step_s)


def test_roofline_card_choices(tmp_path):
    a = args("--card", "h200")
    assert decode.roofline_card(a, [{"device": "NVIDIA H100 80GB HBM3"}])[0].name == "NVIDIA H200"
    card, why = decode.roofline_card(args(), [{"device": "cpu"}])
    assert card is None and "no figures for device cpu" in why
    card, _ = decode.roofline_card(args("--hbm-tbs", "0.02"), [{"device": "cpu"}])
    assert (card.name, card.hbm_tbs, card.bf16_tflops) == ("cpu", 0.02, float("inf"))
    card, _ = decode.roofline_card(args("--hbm-tbs", "0.02", "--tflops", "1"), [{"device": "cpu"}])
    assert (card.bf16_tflops, card.fp8_tflops) == (1.0, 2.0)
    card, _ = decode.roofline_card(args("--hbm-tbs", "4.0"), [{"device": "NVIDIA H200"}])
    assert (card.hbm_tbs, card.bf16_tflops) == (4.0, 989.0)  # one figure overridden


def test_table_prints_both_ratios_and_the_bound(capsys):
    a = args("--engines", "2")
    rows = [{"batch": 64, "routing": "balanced", "mode": "afd", "runs": 1, "tpot_s": 8.23e-3,
             "tpot_min_s": 8.23e-3, "tpot_max_s": 8.23e-3, "decode_tok_s": 15_561.0,
             "vs_plain": 1.47, "vs_one": 0.86, "bound_s": 5.1e-3, "bound_tok_s": 25_100.0,
             "of_bound": 0.62}]
    decode.print_table(a, rows)
    out = capsys.readouterr().out
    assert "vs x2  vs 1x2b   bound ms  bound tok/s  of bound" in out
    assert re.search(r"64 balanced\s+afd\s+8\.23\s+15561\.0\s+1\.47x\s+0\.86x\s+5\.10\s+25100"
                     r"\s+62\.0%", out), out


@pytest.mark.parametrize("argv, message", [
    (["--modes", "plain,plain_one"], "plain_one needs --engines 2 or more"),
    (["--card", "tpu"], "--card tpu: one of auto"),
    (["--hbm-tbs", "0"], "--hbm-tbs and --tflops must be positive"),
    (["--ffn-schedule", "join,pp"], "--ffn-schedule join,pp: a comma list of distinct values "
                                    "of join, pingpong, auto"),
    (["--connector-extra", '{"ffn_schedule": "pingpong"}'], "give the FFN schedule with "
                                                            "--ffn-schedule"),
])  # fmt: skip
def test_refusals(tmp_path, argv, message):
    r = subprocess.run([sys.executable, str(DECODE), "--model", str(tmp_path), *argv],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr


# ------------------------------------------------------------ benchmarks/serve.py


def test_serve_plain_one_doubles_the_server_sizes_and_the_load(tmp_path):
    import serve as bench  # benchmarks/serve.py

    args_ = ["--dtype", "bfloat16", "--max-num-seqs", "64", "--max-num-batched-tokens=64",
             "--kv-cache-memory-bytes", "4294967296", "--compilation-config",
             '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [64]}']
    out = bench.scaled_args(args_, 2)
    assert out[:6] == ["--dtype", "bfloat16", "--max-num-seqs", "128",
                       "--max-num-batched-tokens=128", "--kv-cache-memory-bytes"]
    assert out[6] == str(2 * 4294967296)
    assert json.loads(out[8]) == {"cudagraph_mode": "FULL_DECODE_ONLY",
                                  "cudagraph_capture_sizes": [64, 128]}
    assert json.loads(bench.scaled_args(["-cc", '{"max_cudagraph_capture_size": 256}'], 2)[1]) \
        == {"max_cudagraph_capture_size": 512}
    a = bench.parse_args(["--model", str(tmp_path), "--modes", "plain_one,plain",
                          "--num-prompts", "64", "--warmups", "4"])
    cmd = bench.bench_command(a, "http://x", tmp_path, "r", bench.ONE_OF)
    for flag, want in (("--num-prompts", "128"), ("--max-concurrency", "128"),
                       ("--num-warmups", "8")):
        assert cmd[cmd.index(flag) + 1] == want
    p = subprocess.run([sys.executable, str(Path(bench.__file__)), "--model", str(tmp_path),
                        "--modes", "plain_one", "--serve-args=--max-num-seqs"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cannot double the server sizes" in p.stderr, p.stderr


def test_serve_bounds_and_table(tmp_path, capsys):
    import serve as bench  # benchmarks/serve.py

    model_dir = config_dir(tmp_path)
    a = bench.parse_args(["--model", str(model_dir), "--device", "cuda", "--mps",
                          "--attention-gpu", "0", "--ffn-gpu", "0", "--routing", "balanced",
                          "--num-prompts", "64", "--input-len", "64", "--output-len", "256",
                          "--modes", "plain,plain_x2,plain_one,afd", "--card", "h200"])
    model = plan.load_model(str(model_dir))
    card = plan.CARDS["h200"]
    b = {m: bench.serve_bound(a, m, model, card) for m in a.modes}
    ctx = 64 + 128
    assert b["plain_one"] == plan.step_bound(model, card, "plain_one", 2, 64, ctx, "balanced")
    assert b["plain_x2"] == plan.step_bound(model, card, "plain", 2, 64, ctx, "balanced")
    assert b["afd"] == plan.step_bound(model, card, "afd", 1, 64, ctx, "balanced")
    # --engines 3 and the FFN schedules: replicas, the one server of 3 x the load, MA1F by
    # its schedule (pingpong reads the experts once a rank), none for auto
    m3 = bench.parse_args(["--model", str(model_dir), "--device", "cuda", "--mps",
                           "--attention-gpu", "0", "--ffn-gpu", "0", "--routing", "balanced",
                           "--num-prompts", "64", "--input-len", "64", "--output-len", "256",
                           "--engines", "3", "--modes", "plain,plain_one,afd",
                           "--ffn-schedule", "join,pingpong,auto", "--card", "h200"])
    b3 = {m: bench.serve_bound(m3, m, model, card) for m in m3.modes}
    for mode, kind, engines in (("plain", "plain", 3), ("plain_one", "plain_one", 3),
                                ("afd", "afd", 3), ("afd_pingpong", "afd_pingpong", 3)):
        assert b3[mode] == plan.step_bound(model, card, kind, engines, 64, ctx, "balanced")
    assert b3["afd_pingpong"].bytes > b3["afd"].bytes and b3["afd_auto"] is None
    a.ffn_gpu = "1"  # two GPUs: each replica bounded by its own GPU
    two = bench.serve_bound(a, "plain_x2", model, card)
    assert two.tokens == 128 and two.step_s == pytest.approx(b["plain"].step_s)
    results = [{"mode": m, "round": 0, "output_throughput": t, "mean_tpot_ms": 10.0,
                "mean_ttft_ms": 100.0, "bound_tok_s": b[m].tok_s}
               for m, t in (("plain", 5000.0), ("plain_x2", 7000.0), ("plain_one", 8000.0),
                            ("afd", 4500.0))]
    bench.print_table(a, results)
    out = capsys.readouterr().out
    assert "vs plain  vs plain_one" in out and "decode bound tok/s  of bound" in out
    frac = 7000.0 / b["plain_x2"].tok_s
    assert re.search(rf"plain_x2\s+7000\.0\s+1\.40x\s+0\.88x\s+10\.00\s+100\.0\s+"
                     rf"{b['plain_x2'].tok_s:.0f}\s+{frac:.1%}", out), out
