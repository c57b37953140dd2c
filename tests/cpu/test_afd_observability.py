"""AFD metrics and profiling on a real `vllm serve` pair on the CPU (1 attention + 1 FFN).

* ``/metrics`` of both servers carries the AFD series, and their values move after
  completions (steps, per-layer FFN compute, bytes, wait histograms, peer state);
* ``/start_profile`` + ``/stop_profile`` on the attention server also drive the FFN
  server's profiler: both write a torch trace, and the traces hold the named AFD regions
  (``afd.send`` / ``afd.ffn_wait`` on the attention side, ``afd.recv`` /
  ``afd.ffn_compute`` / ``afd.send`` on the FFN side).
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
from harness import wait_for, wait_healthy

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"  # 3 layers, all served by the FFN rank
START_TIMEOUT_S = 240.0


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
def pair(models_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("afd_obs")
    api_attn, api_ffn, afd_port = su.free_ports(3)
    cfg = dict(port=afd_port, timeout_s=30.0)
    env = {"VLLM_AFD_METRICS_DIR": str(base / "metrics")}
    traces = {"attention": base / "trace_attention", "ffn": base / "trace_ffn"}
    servers: list[su.Server] = []
    try:
        ffn = su.Server.start("ffn", models_dir / MODEL, api_ffn, base / "ffn.log",
                              afd_config=su.afd_config("ffn", **cfg), env=env,
                              extra_args=profiler_args(traces["ffn"]))
        servers.append(ffn)
        attn = su.Server.start("attention", models_dir / MODEL, api_attn,
                               base / "attention.log",
                               afd_config=su.afd_config("attention", **cfg), env=env,
                               extra_args=profiler_args(traces["attention"]))
        servers.append(attn)
        wait_healthy([attn, ffn], START_TIMEOUT_S)
        yield attn, ffn, traces
    finally:
        su.stop_servers(servers)


def scrape(server: su.Server) -> dict[str, float]:
    status, text = su.http_get(f"{server.url}/metrics", timeout=10)
    assert status == 200, text[:500]
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:afd_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


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
        a, f = scrape(attn), scrape(ffn)
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
