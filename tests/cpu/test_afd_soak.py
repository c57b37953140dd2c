"""Bounded soak of an AFD pair of `vllm serve` servers on the CPU (1 attention + 1 FFN).

SOAK_REQUESTS completions of mixed lengths (SOAK_PROMPTS distinct prompts, max_tokens drawn
from 4..48 by a seeded RNG) at concurrency 16 (``--max-num-seqs 16``). Checked: zero
errors; every output's token ids equal the plain vLLM reference (greedy: the output of n
tokens is the n-prefix of the reference of 48 tokens, computed once per prompt with
``afd_proc.py plain``); the resident memory of each server's process group (sum of VmRSS
of its members) after the run within RSS_TOLERANCE of its value after the warm-up (the
first WARMUP requests).
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import AfdProc, wait_healthy

import serve_util as su

pytestmark = [pytest.mark.cpu_e2e, pytest.mark.slow]

MODEL = "qwen3_moe"
AFD_TIMEOUT_S = 60.0  # the plain reference starts alongside the pair: more start-up skew
START_TIMEOUT_S = 300.0
SOAK_REQUESTS = 2000  # at least 500; ~30 s on the 2-core CI machine
SOAK_PROMPTS = 40
CONCURRENCY = 16
MIN_TOKENS, MAX_TOKENS = 4, 48
WARMUP = 100
RSS_TOLERANCE = 0.10
SEED = 1201
SERVE_ARGS = ["--max-num-seqs", str(CONCURRENCY)]

_SUBJECTS = ["The old lighthouse", "A small robot", "My grandmother's kitchen", "The river",
             "An abandoned train station", "The mathematician", "A quiet library",
             "The mountain village"]  # fmt: skip
_OPENINGS = ["", "Once upon a time, ", "Chapter one. ", "Q: Tell me about it.\nA: ",
             "In the year 2040, "]  # fmt: skip


def soak_prompts() -> list[str]:
    """SOAK_PROMPTS distinct prompts of different lengths."""
    pairs = [(o, s) for o in _OPENINGS for s in _SUBJECTS]
    prompts = [f"{o}{s} {'was' if i % 2 else 'is'}" for i, (o, s) in enumerate(pairs)]
    assert len(set(prompts)) == SOAK_PROMPTS == len(prompts)
    return prompts


def test_soak_mixed_requests(model_dir, tmp_path):
    prompts = soak_prompts()
    rng = random.Random(SEED)
    work = [(rng.randrange(SOAK_PROMPTS), rng.randint(MIN_TOKENS, MAX_TOKENS))
            for _ in range(SOAK_REQUESTS)]  # fmt: skip

    # plain reference (one process) while the pair starts
    spec = tmp_path / "prompts.json"
    spec.write_text(json.dumps({"prompts": prompts, "max_tokens": [MAX_TOKENS] * SOAK_PROMPTS}))
    ref = AfdProc("plain", model_dir, tmp_path / "plain.log",
                  ["--prompts", str(spec), "--out", str(tmp_path / "plain.json"),
                   "--max-num-seqs", "16", "--logprobs", "1"])  # fmt: skip
    api_attn, api_ffn, afd_port = su.free_ports(3)
    cfg = dict(port=afd_port, timeout_s=AFD_TIMEOUT_S)
    servers: list[su.Server] = []
    try:
        attn = su.Server.start("attention", model_dir, api_attn, tmp_path / "attention.log",
                               afd_config=su.afd_config("attention", **cfg),
                               extra_args=SERVE_ARGS)  # fmt: skip
        servers.append(attn)
        ffn = su.Server.start(
            "ffn",
            model_dir,
            api_ffn,
            tmp_path / "ffn.log",
            afd_config=su.afd_config("ffn", **cfg),
            extra_args=SERVE_ARGS,
        )
        servers.append(ffn)
        ready = wait_healthy([attn, ffn], START_TIMEOUT_S)
        assert ref.wait_exit(START_TIMEOUT_S) is not None, "plain reference hangs"
        assert ref.p.returncode == 0, su.log_tail(tmp_path / "plain.log")
        reference = [o["token_ids"] for o in
                     json.loads((tmp_path / "plain.json").read_text())["outputs"]]  # fmt: skip
        assert all(len(r) == MAX_TOKENS for r in reference)
        print(f"pair healthy after {ready}")

        done = 0
        lock = threading.Lock()
        warm = threading.Event()
        rss_warm: dict[str, int] = {}
        errors: list[str] = []
        latencies: list[float] = []

        def one(i: int) -> None:
            nonlocal done
            p, n = work[i]
            t0 = time.monotonic()
            try:
                status, body = attn.completion(
                    prompts[p], max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1,
                    return_tokens_as_token_ids=True, timeout=300,
                )  # fmt: skip
                if status != 200:
                    errors.append(f"request {i}: HTTP {status}: {su.error_message(body)[:200]}")
                else:
                    ids = su.token_ids(su.parse_choice(body)["tokens"])
                    if ids != reference[p][:n]:
                        errors.append(f"request {i} (prompt {p}, {n} tokens): output differs "
                                      f"from plain: {ids} != {reference[p][:n]}")  # fmt: skip
            except Exception as e:  # noqa: BLE001 - every failure is counted
                errors.append(f"request {i}: {type(e).__name__}: {e}")
            with lock:
                latencies.append(time.monotonic() - t0)
                done += 1
                if done == WARMUP:
                    rss_warm.update(attention=su.group_rss_kib(attn.pgid),
                                    ffn=su.group_rss_kib(ffn.pgid))  # fmt: skip
                    warm.set()

        t0 = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(SOAK_REQUESTS)))
        wall = time.monotonic() - t0
        rss_end = {"attention": su.group_rss_kib(attn.pgid), "ffn": su.group_rss_kib(ffn.pgid)}
        tokens = sum(n for _, n in work)
        latencies.sort()
        print(f"soak: {SOAK_REQUESTS} requests ({tokens} tokens) at concurrency {CONCURRENCY} "
              f"in {wall:.1f} s: {SOAK_REQUESTS / wall:.2f} req/s, {tokens / wall:.0f} tok/s; "
              f"latency p50 {latencies[len(latencies) // 2]:.2f} s, "
              f"max {latencies[-1]:.2f} s; errors {len(errors)}")  # fmt: skip
        for side in ("attention", "ffn"):
            a, b = rss_warm.get(side, 0), rss_end[side]
            print(f"  RSS {side}: {a / 1024:.0f} MiB after {WARMUP} requests, "
                  f"{b / 1024:.0f} MiB at the end ({(b - a) / max(a, 1):+.1%})")  # fmt: skip
        assert not errors, f"{len(errors)} errors, first: {errors[:5]}"
        assert warm.is_set()
        for side in ("attention", "ffn"):
            a, b = rss_warm[side], rss_end[side]
            assert a > 0 and abs(b - a) <= RSS_TOLERANCE * a, (side, a, b)
        assert attn.alive() and ffn.alive()
        for s in servers:
            text = s.log_path.read_text(errors="replace")
            assert "Traceback" not in text, su.find_traceback(s.log_path)
    finally:
        ref.kill()
        su.stop_servers(servers)
    left = {s.name: su.group_members(s.pgid) for s in servers}
    assert not any(left.values()), f"processes left after stop: {left}"
    assert all(su.port_bindable(p) for p in (api_attn, api_ffn, afd_port))
