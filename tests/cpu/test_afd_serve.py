"""An AFD deployment of two real `vllm serve` processes on the CPU (1 attention + 1 FFN).

The attention server starts FIRST and the FFN server second (the demo starts them the other
way round), with ``timeout_s`` 5 so that the failure test below is quick. Checked:

* concurrent completions of different lengths from the attention server give the same
  greedy tokens (and top-5 logprobs within 1e-4) as plain vLLM in a process of its own
  (``afd_proc.py plain``);
* the FFN server answers /health and refuses generation with a 4xx that mentions AFD;
* benchmarks/serve.py's `vllm bench serve` client gets every request and token through;
* SIGKILL of the FFN server while a long completion streams: the step waits
  ``rejoin_timeout_s`` (default ``timeout_s``) for it to come back, then that request ends
  with an error naming the lost AFD peer within timeout_s + 10 s, later requests fail fast (with the
  same message while the server still answers), and after the stop no process of either
  server is left.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from harness import AfdProc, TokenStream, join_streams, module_log_dir, wait_for, wait_healthy

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
AFD_TIMEOUT_S = 5.0
START_TIMEOUT_S = 240.0
LOGPROB_TOL = 1e-4
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


@pytest.fixture(scope="module")
def pair(model_dir, log_dir, reference):
    """(attention, ffn) servers, the attention one started first. The reference runs first
    so that it does not compete for the 2 CPUs while the servers race to connect."""
    del reference
    api_attn, api_ffn, afd_port = su.free_ports(3)
    cfg = dict(port=afd_port, timeout_s=AFD_TIMEOUT_S)
    servers: list[su.Server] = []
    try:
        attn = su.Server.start("attention", model_dir, api_attn, log_dir / "attention.log",
                               afd_config=su.afd_config("attention", **cfg))
        servers.append(attn)
        time.sleep(1.0)  # the attention server is first by a margin, still within timeout_s
        ffn = su.Server.start("ffn", model_dir, api_ffn, log_dir / "ffn.log",
                              afd_config=su.afd_config("ffn", **cfg))
        servers.append(ffn)
        ready = wait_healthy([attn, ffn], START_TIMEOUT_S)
        print(f"AFD pair healthy: {ready}")
        yield attn, ffn
    finally:
        su.stop_servers(servers)
        left = {s.name: su.group_members(s.pgid) for s in servers}
        assert not any(left.values()), f"processes left after stop: {left}"


def _ids(tokens: list[str]) -> list[int]:
    return su.token_ids(tokens)


def _top(choice: dict) -> list[dict[str, float]]:
    """Server top logprobs ("token_id:N" keys) as afd_proc.py writes them ("N" keys)."""
    return [{k.split(":", 1)[1]: v for k, v in pos.items()} for pos in choice["top_logprobs"]]


def test_ffn_server_health_and_refusal(pair):
    _, ffn = pair
    status, _ = su.http_get(f"{ffn.url}/health")
    assert status == 200
    status, body = ffn.completion("Hello", max_tokens=4, timeout=60)
    msg = su.error_message(body)
    assert 400 <= status < 500, (status, body)
    assert "AFD" in msg, msg


def test_concurrent_completions_match_plain(pair, reference):
    attn, _ = pair
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

    attn, ffn = pair
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
    attn, ffn = pair
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
    # the client's error names the lost peer (patch 0011), not just "EngineCore ..."
    assert "AFD: lost AFD peer FFN rank 0 at 127.0.0.1:" in str(result.get("error")), result
    # the step held for the FFN rank to come back (rejoin_timeout_s, default timeout_s) and
    # then failed as without rejoin (tests/cpu/test_afd_restart.py: one that comes back)
    assert f"did not come back within rejoin_timeout_s={AFD_TIMEOUT_S:g}" in str(
        result.get("error")), result
    assert ended >= AFD_TIMEOUT_S - 1, ended

    # later requests fail fast: an HTTP error or a refused connection, not a hang
    for _ in range(2):
        t0 = time.monotonic()
        try:
            status, body = attn.completion("Hello", max_tokens=4, timeout=AFD_TIMEOUT_S + 10)
            outcome = f"HTTP {status}: {su.error_message(body)[:200]}"
            assert status >= 400, f"request succeeded with a dead FFN: {body}"
            assert "AFD: lost AFD peer FFN rank 0" in su.error_message(body), body
        except OSError as e:
            outcome = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - t0
        print(f"request after the kill: {outcome} ({elapsed:.2f} s)")
        assert elapsed <= AFD_TIMEOUT_S + 5, (elapsed, outcome)

    attn.stop()
    assert attn.gone() and ffn.gone()
