"""An AFD deployment of two real `vllm serve` processes on the CPU (1 attention + 1 FFN),
one pair for the whole module (each start costs both CPUs for about 40 s).

The attention server starts FIRST and the FFN server second (the demo starts them the other
way round), with ``timeout_s`` 5 so that the failure test at the end is quick, and both
with a torch profiler configured and a metrics directory of their own. Checked, in order:

* ``/metrics`` of both servers carries the AFD series, and their values move after
  completions (steps, per-layer FFN compute, bytes, wait histograms, peer state);
* ``/start_profile`` + ``/stop_profile`` on the attention server also drive the FFN
  server's profiler: both write a torch trace, and the traces hold the named AFD regions
  (``afd.send`` / ``afd.ffn_wait`` on the attention side, ``afd.recv`` /
  ``afd.ffn_compute`` / ``afd.send`` on the FFN side);
* the FFN server answers /health and refuses generation with a 4xx that mentions AFD;
* concurrent completions of different lengths from the attention server give the same
  greedy tokens (and top-5 logprobs within 1e-4) as plain vLLM in a process of its own
  (``afd_proc.py plain``);
* benchmarks/serve.py's `vllm bench serve` client gets every request and token through;
* SIGKILL of the FFN server while a long completion streams (last: it ends the pair): the
  step waits ``rejoin_timeout_s`` (default ``timeout_s``) for it to come back, then that
  request ends with an error naming the lost AFD peer within timeout_s + 10 s, later
  requests fail fast (with the same message while the server still answers), and after
  the stop no process of either server is left.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import pytest
from harness import (
    AfdProc,
    TokenStream,
    afd_metrics,
    join_streams,
    module_log_dir,
    request_after_peer_loss,
    wait_for,
    wait_healthy,
)
from oracle_lib import LOGPROB_TOL

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"  # 3 layers, all served by the FFN rank
AFD_TIMEOUT_S = 5.0
START_TIMEOUT_S = 240.0
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "One, two, three,",
    "def add(a, b):",
    "In a hole in the ground there lived",
]
MAX_TOKENS = [4, 9, 16, 23, 30]
PARAMS = {"temperature": 0.0, "logprobs": 5, "ignore_eos": True,
          "return_tokens_as_token_ids": True}


log_dir = module_log_dir("afd_serve_logs")


@pytest.fixture(scope="module")
def reference(model_dir, log_dir) -> list[dict]:
    """Plain vLLM (one engine in a process of its own): token_ids, text, logprobs."""
    prompts = log_dir / "prompts.json"
    out = log_dir / "plain.json"
    prompts.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS}))
    proc = AfdProc("plain", model_dir, log_dir / "plain.log",
                   ["--prompts", str(prompts), "--out", str(out), "--max-num-seqs", "8"])
    rc = proc.wait(300)
    if rc != 0:
        pytest.fail(f"afd_proc.py plain failed (rc={rc}):\n{proc.tail()}", pytrace=False)
    return json.loads(out.read_text())["outputs"]


def profiler_args(trace_dir: Path) -> list[str]:
    cfg = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": True,
        "torch_profiler_dump_cuda_time_total": False,
    }
    return ["--profiler-config", json.dumps(cfg)]


@pytest.fixture(scope="module")
def pair(model_dir, log_dir, reference):
    """(attention, ffn, trace dirs): the servers, the attention one started first. The
    reference runs first so that it does not compete for the 2 CPUs while the servers race
    to connect."""
    del reference
    api_attn, api_ffn, afd_port = su.free_ports(3)
    cfg = dict(port=afd_port, timeout_s=AFD_TIMEOUT_S)
    env = {"VLLM_AFD_METRICS_DIR": str(log_dir / "metrics")}
    traces = {"attention": log_dir / "trace_attention", "ffn": log_dir / "trace_ffn"}
    servers: list[su.Server] = []
    try:
        attn = su.Server.start("attention", model_dir, api_attn, log_dir / "attention.log",
                               afd_config=su.afd_config("attention", **cfg), env=env,
                               extra_args=profiler_args(traces["attention"]))
        servers.append(attn)
        time.sleep(1.0)  # the attention server is first by a margin, still within timeout_s
        ffn = su.Server.start("ffn", model_dir, api_ffn, log_dir / "ffn.log",
                              afd_config=su.afd_config("ffn", **cfg), env=env,
                              extra_args=profiler_args(traces["ffn"]))
        servers.append(ffn)
        ready = wait_healthy([attn, ffn], START_TIMEOUT_S)
        print(f"AFD pair healthy: {ready}")
        yield attn, ffn, traces
    finally:
        su.stop_servers(servers)
        left = {s.name: su.group_members(s.pgid) for s in servers}
        assert not any(left.values()), f"processes left after stop: {left}"


def afd_excerpt(server: su.Server) -> str:
    _, text = su.http_get(f"{server.url}/metrics", timeout=10)
    return "\n".join(ln for ln in text.splitlines()
                     if "afd_" in ln and "_bucket{" not in ln)


A = 'afd_rank="0",role="attention"'
F = 'afd_rank="0",role="ffn"'


def key(name: str, role: str, **labels: str) -> str:
    """A series as /metrics prints it (labels in sorted order)."""
    labels = {"afd_rank": "0", "role": role, **labels}
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"vllm:afd_{name}{{{inner}}}"


STEPS_A = f"vllm:afd_steps_total{{{A}}}"
SERVED_F = f"vllm:afd_ffn_steps_served_total{{{F}}}"
# (attention series, FFN series) that must be equal: steps, and the bytes each way
AGREEING = ((STEPS_A, SERVED_F),
            (f"vllm:afd_bytes_sent_total{{{A}}}", f"vllm:afd_bytes_received_total{{{F}}}"),
            (f"vllm:afd_bytes_received_total{{{A}}}", f"vllm:afd_bytes_sent_total{{{F}}}"))


def agreeing_scrapes(attn, ffn, timeout: float, what: str, ready=lambda a, f: True):
    """Scrapes of both servers whose AFD counters agree: one attention rank, so every
    attention step is one FFN step and the bytes one side sent are the bytes the other
    received, warm-up steps included. Each role's snapshot is refreshed every 0.5 s by a
    thread of its worker, later on a loaded machine (seen in CI: an FFN snapshot one step
    behind), so scrape until the two agree and `ready(a, f)` holds; a real disagreement
    outlasts `timeout` and fails with both sides' figures."""
    deadline = time.monotonic() + timeout
    while True:
        a, f = afd_metrics(attn), afd_metrics(ffn)
        if all(a.get(x, -1.0) == f.get(y, -2.0) for x, y in AGREEING) and ready(a, f):
            return a, f
        assert time.monotonic() < deadline, (
            f"{what} not reached within {timeout} s: "
            + ", ".join(f"{x}={a.get(x)} vs {y}={f.get(y)}" for x, y in AGREEING))
        time.sleep(0.25)


def test_metrics_series_move_after_requests(pair):
    attn, ffn, _ = pair
    # The baseline: agreeing, and still the same a second later (two refreshes of each
    # side), so that no warm-up step is left to show up in one side's figures later.
    a0, f0 = agreeing_scrapes(attn, ffn, 20, "both roles' AFD counters agreeing")
    for _ in range(10):
        time.sleep(1.0)
        a, f = agreeing_scrapes(attn, ffn, 20, "both roles' AFD counters agreeing")
        settled = a[STEPS_A] == a0[STEPS_A]
        a0, f0 = a, f
        if settled:
            break
    else:
        pytest.fail(f"AFD step counters still moving before any request: {a0[STEPS_A]}")
    assert a0[key("peer_up", "attention", peer="ffn_rank_0")] == 1, a0
    assert f0[key("peer_up", "ffn", peer="attention_rank_0")] == 1, f0
    for k in (STEPS_A, f"vllm:afd_step_ffn_wait_seconds_count{{{A}}}",
              f"vllm:afd_handshake_failures_total{{{A}}}"):
        assert k in a0, sorted(a0)
    for k in (SERVED_F, f"vllm:afd_ffn_idle_seconds_total{{{F}}}",
              f"vllm:afd_ffn_step_compute_seconds_count{{{F}}}"):
        assert k in f0, sorted(f0)

    n_tokens = 12
    for prompt in ("Hello, my name is", "The capital of France is"):
        status, body = attn.completion(prompt, max_tokens=n_tokens, temperature=0.0,
                                       ignore_eos=True)
        assert status == 200, body

    # One request after the other: each is one prefill + (n_tokens - 1) decode steps. Wait
    # until both sides show all of them (and agree: bytes sent == bytes received).
    expected = 2 * n_tokens
    a1, f1 = agreeing_scrapes(attn, ffn, 20, "AFD step counters moving",
                              lambda a, f: a[STEPS_A] - a0[STEPS_A] >= expected)
    steps, served = a1[STEPS_A] - a0[STEPS_A], f1[SERVED_F] - f0[SERVED_F]
    # one attention rank: every attention step is exactly one FFN step
    assert steps == served == expected, (steps, served)
    layers = (a1[f"vllm:afd_layer_exchanges_total{{{A}}}"]
              - a0[f"vllm:afd_layer_exchanges_total{{{A}}}"])
    assert layers == 3 * steps
    assert (a1[f"vllm:afd_step_ffn_wait_seconds_count{{{A}}}"]
            > a0[f"vllm:afd_step_ffn_wait_seconds_count{{{A}}}"])
    assert (a1[f"vllm:afd_step_ffn_wait_seconds_sum{{{A}}}"]
            > a0[f"vllm:afd_step_ffn_wait_seconds_sum{{{A}}}"])
    assert a1[f"vllm:afd_bytes_sent_total{{{A}}}"] > a0[f"vllm:afd_bytes_sent_total{{{A}}}"]
    # (what the attention side sent is what the FFN side received, and back: agreeing_scrapes)
    for layer in range(3):
        secs = key("ffn_layer_compute_seconds_total", "ffn", layer=str(layer))
        calls = key("ffn_layer_calls_total", "ffn", layer=str(layer))
        assert f1[secs] > f0.get(secs, 0.0), secs
        assert f1[calls] - f0.get(calls, 0.0) == expected, calls
    assert f1[f"vllm:afd_ffn_idle_seconds_total{{{F}}}"] > 0
    print("--- attention /metrics (AFD series, buckets left out) ---")
    print(afd_excerpt(attn))
    print("--- FFN /metrics (AFD series, buckets left out) ---")
    print(afd_excerpt(ffn))


def _trace_names(path: Path) -> set[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return {ev.get("name", "") for ev in trace.get("traceEvents", [])}


def test_profile_controls_drive_both_roles(pair):
    attn, ffn, traces = pair
    status, body = su.post_json(f"{attn.url}/start_profile", {}, timeout=60)
    assert status == 200, body
    for prompt in ("One, two, three,", "def add(a, b):"):
        status, body = attn.completion(prompt, max_tokens=6, temperature=0.0)
        assert status == 200, body
    status, body = su.post_json(f"{attn.url}/stop_profile", {}, timeout=120)
    assert status == 200, body

    def written(role):
        files = sorted(traces[role].glob("*.json*")) if traces[role].is_dir() else []
        return [f for f in files if ".tmp" not in f.name]

    a_files = wait_for(lambda: written("attention"), 60, "attention trace")
    f_files = wait_for(lambda: written("ffn"), 60, "FFN trace")
    assert any("afd-ffn-rank0" in f.name for f in f_files), f_files

    def names(files):
        # the trace handler may still be writing: retry until the JSON parses
        def parse():
            try:
                return set().union(*(_trace_names(f) for f in files))
            except (EOFError, OSError, ValueError):
                return None
        return wait_for(parse, 30, f"complete trace in {files}")

    a_names, f_names = names(a_files), names(f_files)
    assert {"afd.send", "afd.ffn_wait"} <= a_names, sorted(n for n in a_names if "afd" in n)
    assert {"afd.recv", "afd.ffn_compute", "afd.send"} <= f_names, (
        sorted(n for n in f_names if "afd" in n))
    assert "afd.ffn_compute" not in a_names
    print(f"traces: attention {[f.name for f in a_files]}, FFN {[f.name for f in f_files]}")


def _ids(tokens: list[str]) -> list[int]:
    return su.token_ids(tokens)


def _top(choice: dict) -> list[dict[str, float]]:
    """Server top logprobs ("token_id:N" keys) as afd_proc.py writes them ("N" keys)."""
    return [{k.split(":", 1)[1]: v for k, v in pos.items()} for pos in choice["top_logprobs"]]


def test_ffn_server_health_and_refusal(pair):
    _, ffn, _ = pair
    status, _ = su.http_get(f"{ffn.url}/health")
    assert status == 200
    status, body = ffn.completion("Hello", max_tokens=4, timeout=60)
    msg = su.error_message(body)
    assert 400 <= status < 500, (status, body)
    assert "AFD" in msg, msg


def test_concurrent_completions_match_plain(pair, reference):
    attn, _, _ = pair
    results: list = [None] * len(PROMPTS)

    def one(i: int) -> None:
        results[i] = attn.completion(PROMPTS[i], max_tokens=MAX_TOKENS[i], timeout=120,
                                     **PARAMS)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    print(f"{len(PROMPTS)} concurrent AFD completions in {time.monotonic() - t0:.2f} s")

    for prompt, n, res, ref in zip(PROMPTS, MAX_TOKENS, results, reference):
        assert res is not None, f"{prompt!r}: no answer"
        status, body = res
        assert status == 200, (prompt, body)
        got = su.parse_choice(body)
        assert len(got["tokens"]) == n == len(ref["token_ids"])
        assert _ids(got["tokens"]) == ref["token_ids"], prompt
        assert got["text"] == ref["text"], prompt
        diff = su.max_logprob_diff(_top(got), ref["logprobs"])
        assert diff <= LOGPROB_TOL, f"{prompt!r}: max |logprob diff| {diff:.3g}"


def test_serving_benchmark_client_against_the_pair(pair, model_dir, tmp_path):
    """benchmarks/serve.py's client half (`vllm bench serve`, warm-ups, the result) against
    this AFD pair's attention server: every request completes with every token."""
    import serve as bench  # benchmarks/serve.py

    attn, ffn, _ = pair
    a = bench.parse_args(["--model", str(model_dir), "--num-prompts", "4",
                          "--warmups", "1", "--input-len", "8", "--output-len", "6"])
    (r,) = bench.run_clients(a, "afd", [attn], tmp_path)
    fig = bench.combine([r])
    assert fig["completed"] == 4
    assert fig["total_output_tokens"] == 4 * 6  # ignore_eos: every token asked for
    assert fig["output_throughput"] == pytest.approx(fig["total_output_tokens"]
                                                     / fig["duration"], rel=1e-3)
    assert fig["mean_tpot_ms"] > 0
    assert attn.alive() and ffn.alive()


def test_killed_ffn_fails_requests_fast(pair):
    attn, ffn, _ = pair
    stream = TokenStream(attn, "Once upon a time", 480, timeout=AFD_TIMEOUT_S + 60)
    wait_for(lambda: stream.ids, 60, "a streamed token")
    t_kill = time.monotonic()
    ffn.kill()
    assert ffn.gone()
    running = join_streams([stream], AFD_TIMEOUT_S + 10 + 5)
    ended = time.monotonic() - t_kill
    result = stream.result or {}
    print(f"in-flight request ended {ended:.1f} s after the kill: {result}")
    assert not running, f"request still running {ended:.0f} s after the FFN kill"
    assert ended <= AFD_TIMEOUT_S + 10, ended
    completed = result.get("finish_reason") == "length" and result.get("error") is None
    assert not completed, f"request finished normally despite the dead FFN: {result}"
    # the client's error names the lost peer (patch engine-dead-peer), not just "EngineCore ..."
    assert "AFD: lost AFD peer FFN rank 0 at 127.0.0.1:" in str(result.get("error")), result
    # the step held for the FFN rank to come back (rejoin_timeout_s, default timeout_s) and
    # then failed as without rejoin (tests/cpu/test_afd_restart.py: one that comes back)
    assert f"did not come back within rejoin_timeout_s={AFD_TIMEOUT_S:g}" in str(
        result.get("error")), result
    assert ended >= AFD_TIMEOUT_S - 1, ended

    # later requests fail fast: an HTTP error or a refused connection, not a hang
    for _ in range(2):
        t0 = time.monotonic()
        outcome = request_after_peer_loss(attn, AFD_TIMEOUT_S + 10)
        if outcome.startswith("HTTP"):
            assert "AFD: lost AFD peer FFN rank 0" in outcome, outcome
        elapsed = time.monotonic() - t0
        print(f"request after the kill: {outcome} ({elapsed:.2f} s)")
        assert elapsed <= AFD_TIMEOUT_S + 5, (elapsed, outcome)

    attn.stop()
    assert attn.gone() and ffn.gone()
