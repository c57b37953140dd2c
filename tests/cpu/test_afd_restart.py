"""No request lost when the FFN server restarts: a `vllm serve` AFD pair on the
CPU (1 attention + 1 FFN, connector gloo) streams 16 concurrent greedy requests; the whole
FFN server is stopped (SIGKILL to its process group, or SIGTERM to its API server: an
upgrade) and started again on the same ports N seconds after it is gone. Every request
completes, with no client error and the greedy tokens of plain vLLM (``afd_proc.py plain``),
and while the outage lasts the attention server's /health answers 503 with the reason and its
/metrics say it (``vllm:afd_peer_up`` 0, ``vllm:afd_peer_outage_seconds`` growing); afterwards
/health is 200 again and the rejoin is counted.

One pair serves all three outages (SIGKILL with N = 2 and 15 s, SIGTERM with N = 2 s); the
attention server's ``rejoin_timeout_s`` covers an FFN restart on this loaded 2-core machine.
The stop comes while every request is mid-decode, by construction rather than by timing: the
streams start with the FFN server frozen (SIGSTOP to its process group), and it runs in short
slices until every stream has a token; the servers run niced, so that this process times the
slices and reads the chunks on time. (On the loaded 2-core machine, "every stream has a
token" seen by the client once meant "every request done" for the engine.) A case that fails
midway leaves the pair as the next case needs it (``Pair.restore``).

The bounded failure once ``rejoin_timeout_s`` has passed is
tests/cpu/test_afd_serve.py::test_killed_ffn_fails_requests_fast (the default window,
``timeout_s`` 5 s there); the fail-fast path (``rejoin_timeout_s`` 0) is test_afd_faults.py.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from harness import (
    TokenStream,
    afd_metrics,
    first_token_after,
    join_streams,
    module_log_dir,
    start_plain,
    wait_for,
    wait_healthy,
)

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
AFD_TIMEOUT_S = 30.0
REJOIN_TIMEOUT_S = 240.0  # an FFN server restart takes 20-60 s on the loaded CI machine
START_TIMEOUT_S = 300.0
N_STREAMS = 16
MAX_TOKENS = 160  # room for the steps of the slices (streams_mid_decode)
PROMPTS = [f"Story number {i}: once upon a time" for i in range(N_STREAMS)]
SEQS = ["--max-num-seqs", str(N_STREAMS)]  # all 16 run at once (the CPU default is 8)
STREAM_IDLE_S = 300.0  # a client waits this long for a chunk (the outage is silent)
SLICE_S = 0.05  # the frozen FFN server runs this long between two looks (3-5 decode steps)
SERVER_NICE = 19  # the servers yield the CPU to this process, which times the slices
QUIET_S = 1.0  # the streams' chunks have all arrived once none came for this long
SETTLE_S = 15.0  # ... within this (the FFN server is frozen: well below AFD_TIMEOUT_S)

FIGURES: dict[str, str] = {}


log_dir = module_log_dir("afd_restart_logs")


@pytest.fixture(scope="module")
def reference(model_dir, log_dir) -> list[list[int]]:
    """Plain vLLM's greedy token ids of PROMPTS (an engine in a process of its own)."""
    spec = {"prompts": PROMPTS, "max_tokens": [MAX_TOKENS] * N_STREAMS}
    proc = start_plain(model_dir, log_dir, spec, max_num_seqs=16)
    return [o["token_ids"] for o in proc.output(300)["outputs"]]


class Pair:
    """The attention server and a restartable FFN server on fixed ports."""

    def __init__(self, model_dir: Path, log_dir: Path):
        self.model_dir, self.log_dir = model_dir, log_dir
        self.api_attn, self.api_ffn, self.afd_port = su.free_ports(3)
        self.servers: list[su.Server] = []
        self.ffn: su.Server | None = None
        self.attn: su.Server | None = None
        self.streams: list[TokenStream] = []
        self._n = 0

    def config(self, role: str) -> dict:
        return su.afd_config(role, port=self.afd_port, timeout_s=AFD_TIMEOUT_S,
                             rejoin_timeout_s=REJOIN_TIMEOUT_S)  # fmt: skip

    def start_ffn(self) -> su.Server:
        self._n += 1
        self.ffn = su.Server.start("ffn", self.model_dir, self.api_ffn,
                                   self.log_dir / f"ffn{self._n}.log",
                                   afd_config=self.config("ffn"), extra_args=SEQS)  # fmt: skip
        self.added(self.ffn)
        return self.ffn

    def start(self) -> None:
        self.attn = su.Server.start("attention", self.model_dir, self.api_attn,
                                    self.log_dir / "attention.log",
                                    afd_config=self.config("attention"),
                                    extra_args=SEQS)  # fmt: skip
        self.added(self.attn)
        self.start_ffn()
        print(f"AFD pair healthy: {wait_healthy([self.attn, self.ffn], START_TIMEOUT_S)}")

    def added(self, srv: su.Server) -> None:
        """A server of the pair, at SERVER_NICE (set on its first process, which starts
        the others later, so that all inherit it): on the 2 busy CPUs, a test process
        competing evenly with some 100 threads of the two servers woke from a 0.05 s sleep
        seconds late (the FFN server ran on meanwhile), and its streams read chunks seconds
        after the engine made them."""
        os.setpriority(os.PRIO_PGRP, srv.pgid, SERVER_NICE)
        self.servers.append(srv)

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP (``frozen``) or SIGCONT to the FFN server's whole process group."""
        os.killpg(self.ffn.pgid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def restore(self) -> None:
        """The pair as a case needs it, after a case that failed midway: the FFN server
        running (thawed, or started again once gone), its peer up, the old streams ended."""
        if self.ffn.gone():
            self.start_ffn()
        else:
            self.freeze(False)
        wait_healthy([self.attn, self.ffn], START_TIMEOUT_S)
        assert not join_streams(self.streams, START_TIMEOUT_S), "a case's streams still run"
        wait_for(lambda: scrape(self.attn)["vllm:afd_peer_up"] == 1.0, 30, "vllm:afd_peer_up 1")

    def stop(self) -> None:
        if self.ffn is not None and not self.ffn.gone():
            self.freeze(False)  # a failed case may leave it frozen, deaf to SIGTERM
        su.stop_servers(self.servers)
        left = {s.log_path.name: su.group_members(s.pgid) for s in self.servers}
        assert not any(left.values()), f"processes left after stop: {left}"


@pytest.fixture(scope="module")
def pair(model_dir, log_dir, reference):
    del reference  # first, so that it does not compete with the servers' start
    p = Pair(model_dir, log_dir)
    try:
        p.start()
        yield p
    finally:
        p.stop()
        print("\nfigures of test_afd_restart:")
        for k, v in FIGURES.items():
            print(f"  {k}: {v}")


def scrape(srv: su.Server) -> dict[str, float]:
    """The attention role's AFD series of ``srv`` by name (one attention rank)."""
    return {series.split("{", 1)[0]: v for series, v in afd_metrics(srv).items()
            if 'role="attention"' in series}  # fmt: skip


def settled(streams: list[TokenStream]) -> list[int]:
    """The streams' token counts once no chunk came for QUIET_S s (fails after SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    counts = [len(s.ids) for s in streams]
    while True:
        time.sleep(QUIET_S)
        now = [len(s.ids) for s in streams]
        if now == counts:
            return counts
        assert time.monotonic() < deadline, f"chunks still arriving after {SETTLE_S} s: {now}"
        counts = now


def streams_mid_decode(pair: Pair) -> list[TokenStream]:
    """PROMPTS streamed from the attention server while the FFN server is frozen; it runs
    SLICE_S at a time until every stream has a token, and is left frozen. A slice is a few
    decode steps (the servers run niced, so this process wakes on time to end it), and the
    slices until the last request is admitted a few more: MAX_TOKENS leaves ample room (the
    caller asserts it did)."""
    pair.freeze(True)
    pair.streams = [TokenStream(pair.attn, p, MAX_TOKENS, STREAM_IDLE_S) for p in PROMPTS]
    deadline = time.monotonic() + 120
    while not all(settled(pair.streams)):
        assert time.monotonic() < deadline, "a token on every stream not reached within 120 s"
        pair.freeze(False)
        time.sleep(SLICE_S)
        pair.freeze(True)
    return pair.streams


def stop_ffn(pair: Pair, sig: int) -> None:
    """Stops the frozen FFN server. SIGKILL: its whole process group (a crash). SIGTERM: its
    API server (an upgrade stops it so), thawed; the server then ends its engine and exits."""
    ffn = pair.ffn
    if sig == signal.SIGKILL:
        ffn.kill()
    else:
        os.kill(ffn.proc.pid, signal.SIGTERM)
        pair.freeze(False)
        assert su.wait_for_exit(ffn.proc, 60) is not None, "FFN server ignored SIGTERM"
    wait_for(ffn.gone, 30, "no process of the FFN server left")
    wait_for(lambda: su.port_bindable(pair.afd_port) and su.port_bindable(pair.api_ffn), 30,
             "the FFN server's ports free")  # fmt: skip


def rejoin_line(attn: su.Server, nth: int) -> str:
    """The attention log's nth 'rejoined' line (1-based)."""
    text = attn.log_path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "rejoined FFN rank 0" in ln]
    return lines[nth - 1] if len(lines) >= nth else ""


@pytest.mark.parametrize(
    "sig, down_s",
    [(signal.SIGKILL, 2.0), (signal.SIGKILL, 15.0), (signal.SIGTERM, 2.0)],
    ids=["sigkill-2s", "sigkill-15s", "sigterm-2s"],
)
def test_ffn_restart_loses_no_request(pair, reference, sig, down_s):
    pair.restore()
    attn = pair.attn
    before = scrape(attn)
    assert before["vllm:afd_peer_up"] == 1.0
    rejoins = before.get("vllm:afd_rejoins_total", 0.0)
    streams = streams_mid_decode(pair)
    counts = [len(s.ids) for s in streams]
    assert max(counts) < MAX_TOKENS, f"a request ended before the stop: tokens {counts}"
    t_stop = time.monotonic()
    stop_ffn(pair, sig)
    t_gone = time.monotonic()
    assert any(len(s.ids) < MAX_TOKENS for s in streams), (
        "every stream ended while the FFN server stopped"
    )

    # while the FFN server is down: the attention server is up, says so, and waits
    got = wait_for(lambda: (m := scrape(attn))["vllm:afd_peer_up"] == 0.0 and m, 30,
                   "vllm:afd_peer_up 0")  # fmt: skip
    # /health: alive but not ready (patch health-afd-wait), with the reason
    status, body = su.http_get(f"{attn.url}/health", timeout=5)
    assert status == 503 and attn.alive(), (status, body)
    assert body.startswith("AFD: waiting for a lost FFN rank to come back: attention rank 0"), body
    time.sleep(max(0.0, down_s - (time.monotonic() - t_gone)))  # the outage's length
    outage = scrape(attn)["vllm:afd_peer_outage_seconds"]
    assert outage >= down_s - 0.5, (outage, got)

    t_start = time.monotonic()
    ffn = pair.start_ffn()
    assert not join_streams(streams, START_TIMEOUT_S), "streams still running after the restart"
    wait_healthy([attn, ffn], START_TIMEOUT_S)
    resumed = first_token_after(streams, t_start)
    errors = [s.result and s.result["error"] for s in streams if not s.result or s.result["error"]]
    assert not errors, errors
    for i, s in enumerate(streams):
        assert s.result["finish_reason"] == "length" and s.result["done"], s.result
        assert s.ids == reference[i], f"stream {i}: tokens differ from plain vLLM"
    after = scrape(attn)
    assert su.http_get(f"{attn.url}/health", timeout=5)[0] == 200
    assert after["vllm:afd_peer_up"] == 1.0
    assert after["vllm:afd_peer_outage_seconds"] == 0.0
    assert after["vllm:afd_rejoins_total"] == rejoins + 1
    line = rejoin_line(attn, int(rejoins) + 1)
    m = re.search(r"after ([0-9.]+) s without it", line)
    assert m, line
    name = f"{signal.Signals(sig).name} FFN, restarted {down_s:g} s after it was gone"
    FIGURES[name] = (
        f"tokens per stream at the stop {min(counts)}-{max(counts)} of {MAX_TOKENS}; "
        f"stop took {t_gone - t_stop:.1f} s; outage {float(m.group(1)):.1f} s (loss to "
        f"rejoin); FFN start to the first token {resumed - t_start:.1f} s; "
        f"{N_STREAMS}/{N_STREAMS} requests completed, tokens equal to plain vLLM"
    )
    print(FIGURES[name])
