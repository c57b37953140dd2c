"""benchmarks/serve.py: its refusals of bad arguments, and the servers and clients of each
mode with --engines M and --ffn-schedule (server starts stood in for). Its client half runs
against a real AFD pair in tests/cpu/test_afd_serve.py (the servers are those of
serve_util, which that module starts and stops)."""

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
        (["--engines", "0"], r"--engines must be at least 1"),
        (["--engines", "2", "--modes", "plain_x2", "--device", "cuda", "--mps"],
         r"--engines M: plain runs the M replicas"),
        (["--engines", "3", "--device", "cuda"], r"--engines M on CUDA needs --mps"),
        (["--ffn-schedule", "join,zigzag"], r"--ffn-schedule join,zigzag: a comma list"),
        (["--connector-extra", '{"ffn_schedule": "pingpong"}'],
         r"give the FFN schedule with --ffn-schedule"),
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


class _Started:
    """A stand-in server: its name, the --afd-config it was given, its load factor."""

    def __init__(self, name, afd, factor, log_path):
        self.name, self.afd, self.factor, self.log_path = name, afd, factor, log_path


def test_engines_m_starts_replicas_one_server_and_ma1f_per_schedule(tmp_path, monkeypatch):
    """--engines 3: plain is three replicas (each a client), plain_one one server of three
    times the load (one client), afd one FFN server of three attention ranks 0..2 (each a
    client) once per FFN schedule, the schedule in both roles' connector_extra_config."""
    import serve as bench  # benchmarks/serve.py

    import serve_util as su

    a = bench.parse_args(["--model", str(tmp_path), "--engines", "3", "--modes",
                          "plain,plain_one,afd", "--ffn-schedule", "join,pingpong",
                          "--connector-extra", '{"ffn_hot_poll": false}'])
    assert a.modes == ["plain", "plain_one", "afd", "afd_pingpong"]

    def start(a, name, work, *, afd=None, env=None, extra=None, factor=1):
        return _Started(name, afd, factor, tmp_path / f"{name}.log")

    monkeypatch.setattr(bench, "start", start)
    monkeypatch.setattr(su, "wait_all_healthy", lambda servers, timeout: {})
    got = {m: bench.servers_for(a, m, tmp_path) for m in a.modes}
    assert [s.name for s in got["plain"]] == ["plain_0", "plain_1", "plain_2"]
    assert [(s.name, s.factor) for s in got["plain_one"]] == [("plain_one", 3)]
    servers = got["afd_pingpong"]
    assert [s.name for s in servers] == ["afd_pingpong_attention_0", "afd_pingpong_attention_1",
                                         "afd_pingpong_attention_2", "afd_pingpong_ffn"]
    assert [s.afd.get("rank") for s in servers[:3]] == [0, 1, 2]
    for s in servers:
        assert s.afd["num_attention_ranks"] == 3
        assert s.afd["connector_extra_config"] == {"ffn_hot_poll": False,
                                                   "ffn_schedule": "pingpong"}
    assert got["afd"][3].afd["connector_extra_config"] == {"ffn_hot_poll": False}
    assert [bench.client_count(a, m) for m in a.modes] == [3, 1, 3, 3]
    assert [bench.load_factor(a, m) for m in a.modes] == [1, 3, 1, 1]
    cmd = bench.bench_command(a, "http://x", tmp_path, "r", bench.load_factor(a, "plain_one"))
    assert cmd[cmd.index("--num-prompts") + 1] == str(3 * a.num_prompts)
    # one engine: plain is one server, plain_one takes plain_x2's two replicas' load
    one = bench.parse_args(["--model", str(tmp_path), "--modes", "plain,plain_one,afd"])
    assert [bench.client_count(one, m) for m in one.modes] == [1, 1, 1]
    assert bench.load_factor(one, "plain_one") == 2
    assert [s.name for s in bench.servers_for(one, "afd", tmp_path)] == ["afd_attention",
                                                                       "afd_ffn"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batches", "0,16"], r"--batches .*a comma list of positive integers"),
        (["--batches", "16,x"], r"--batches .*a comma list of positive integers"),
        (["--batches", "16", "--num-prompts", "4"], r"drop --num-prompts and --max-concurrency"),
        (["--batches", "16", "--max-concurrency", "4"], r"drop --num-prompts"),
        (["--batches", "16,256", "--serve-args", "--dtype bfloat16 --max-num-seqs=64"],
         r"--batches 256 with --max-num-seqs 64: a server would run at most 64"),
    ],
)
def test_bad_batches_are_refused(args, message, tmp_path):
    test_bad_arguments_are_refused(args, message, tmp_path)


def test_batches_measure_every_size_against_servers_started_once(tmp_path, monkeypatch):
    """--batches 64,16: each mode's servers start once and are measured at 16 then 64 (B
    requests per client at once, B warm-ups, plain_one M x B); each AFD figure lists the
    FFN server's captures since the figure before; a short count at one size fails."""
    import serve as bench  # benchmarks/serve.py

    import serve_util as su

    a = bench.parse_args(["--model", str(tmp_path), "--engines", "2", "--modes",
                          "plain_one,afd", "--batches", "64,16",
                          "--serve-args", "--max-num-seqs 64"])
    assert a.batches == [16, 64] and a.num_prompts == 64
    started, stopped, asked = [], [], []
    ffn_log = tmp_path / "ffn.log"
    ffn_log.write_text("captured a CUDA graph for step (0, 1) in 30.0 ms\n")

    def servers_for(a, mode, work):
        started.append(mode)
        names = ["plain_one"] if mode == "plain_one" else ["attn_0", "attn_1", "ffn"]
        return [_Started(n, None, 1, ffn_log) for n in names]

    def run_clients(at, mode, clients, work):
        asked.append((mode, at.num_prompts, at.warmups, at.max_concurrency, work.name))
        cmd = bench.bench_command(at, "http://x", work, "r", bench.load_factor(at, mode))
        sent = int(cmd[cmd.index("--num-prompts") + 1])
        assert cmd[cmd.index("--max-concurrency") + 1] == str(sent)
        assert cmd[cmd.index("--num-warmups") + 1] == str(sent)
        if mode == "afd":  # the FFN server captures a graph while serving
            with ffn_log.open("a") as f:
                f.write(f"captured a CUDA graph for step ({at.num_prompts},) in 5.0 ms\n")
        lost = 1 if (mode, at.num_prompts) == ("afd", 64) and short else 0
        return [{"completed": sent - lost, "output_throughput": 100.0 * sent}
                for _ in clients]

    monkeypatch.setattr(bench, "servers_for", servers_for)
    monkeypatch.setattr(bench, "run_clients", run_clients)
    monkeypatch.setattr(_Started, "check_alive", lambda self: None, raising=False)
    monkeypatch.setattr(su, "stop_servers", lambda servers: stopped.append(len(servers)))
    short, figs = False, []
    for mode in a.modes:
        bench.measure(a, mode, tmp_path / mode,
                      lambda at, fig: figs.append((at.num_prompts, fig)))
    assert started == ["plain_one", "afd"] and stopped == [1, 3]
    assert [x[:4] for x in asked] == [("plain_one", 16, 16, None), ("plain_one", 64, 64, None),
                                      ("afd", 16, 16, None), ("afd", 64, 64, None)]
    assert [x[4] for x in asked] == ["b16", "b64"] * 2
    assert [(b, f["completed"]) for b, f in figs] == [(16, 32), (64, 128), (16, 32),
                                                      (64, 128)]
    assert [len(f.get("ffn_graph_captures", [])) for _, f in figs] == [0, 0, 2, 1]
    assert figs[3][1]["ffn_graph_captures"] == [{"step": "(64,)", "ms": 5.0}]
    short, figs = True, []
    with pytest.raises(bench.BenchError, match="126 of 128 requests completed at batch 64"):
        bench.measure(a, "afd", tmp_path / "again",
                      lambda at, fig: figs.append(at.num_prompts))
    assert figs == [16] and stopped[-1] == 3
