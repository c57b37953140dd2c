"""FFN replicas failover: two FFN replicas (`vllm serve` on the CPU, one per FFN
rank, each holding every expert) serve two attention servers (ranks 0 and 1, one each),
all with ``connector_extra_config.ffn_failover``. While both ranks stream greedy requests,
FFN rank 0 is SIGKILLed (its whole process group).

Checked: attention rank 0 fails over to FFN rank 1 (which takes it as a guest) and every
stream of both ranks completes with no client error and the greedy tokens of plain vLLM
(``afd_proc.py plain``); FFN rank 0, started again on its ports, takes its rank back: rank
0 moves home between steps (a goodbye to FFN rank 1, which lets the guest go), and its next
requests are served by FFN rank 0 (its step counter grows), again with plain vLLM's tokens.
The outage (loss to failover) and the times to the move home are printed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from harness import (
    AfdProc,
    TokenStream,
    afd_metrics,
    free_afd_port,
    join_streams,
    module_log_dir,
    start_plain,
    wait_for,
    wait_healthy,
    wait_log,
)

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
AFD_TIMEOUT_S = 60.0
REJOIN_TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0
PROMPTS = [f"Story number {i}: once upon a time" for i in range(4)]
STREAM_TOKENS = 64


log_dir = module_log_dir("afd_failover_logs")


def plain_reference(model_dir: Path, log_dir: Path) -> AfdProc:
    return start_plain(model_dir, log_dir,
                       {"prompts": PROMPTS, "max_tokens": [STREAM_TOKENS] * len(PROMPTS)})


def streams_on(servers: list[su.Server]) -> list[TokenStream]:
    streams = [TokenStream(srv, p, STREAM_TOKENS) for srv in servers for p in PROMPTS]
    wait_for(lambda: all(s.ids for s in streams), 120, "a token on every stream", poll=0.05)
    return streams


def assert_complete(streams: list[TokenStream], want: list[list[int]]) -> None:
    """No stream failed; each has plain vLLM's greedy tokens."""
    running = join_streams(streams, 240)
    assert not running, [(s.srv.name, s.prompt) for s in running]
    for s in streams:
        assert s.result["error"] is None and s.result["done"], (s.srv.name, s.result)
        assert s.result["finish_reason"] == "length", (s.srv.name, s.result)
        assert s.ids == want[PROMPTS.index(s.prompt)], f"{s.srv.name} {s.prompt!r}: tokens"


def steps_served(srv: su.Server) -> float:
    found = [v for series, v in afd_metrics(srv).items()
             if series.startswith("vllm:afd_ffn_steps_served_total{")]  # fmt: skip
    assert found, "no vllm:afd_ffn_steps_served_total on the FFN server"
    return sum(found)


def served_so_far(srv: su.Server, timeout: float) -> float:
    """steps_served once the server's HTTP side answers (bounded). Its /health is not
    waited for: it answers 503 while any AFD snapshot of a descendant process says an
    attention rank waits for its FFN rank, and a stale snapshot of a dead attention
    process whose pid a child of this server reuses says so too."""
    deadline = time.monotonic() + timeout
    while True:
        srv.check_alive()
        try:
            if su.http_get(f"{srv.url}/metrics", timeout=5)[0] == 200:
                return steps_served(srv)
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{srv.name}: /metrics not up in {timeout} s"
        time.sleep(0.5)


def test_ffn_replica_killed_ranks_fail_over_and_move_home(model_dir, log_dir):
    reference = plain_reference(model_dir, log_dir)
    api0, api1, api_f0, api_f1 = su.free_ports(4)
    cfg = dict(port=free_afd_port(2), timeout_s=AFD_TIMEOUT_S, num_attention_ranks=2,
               num_ffn_ranks=2, connector_extra_config={"ffn_failover": True})  # fmt: skip
    servers: list[su.Server] = []

    def start(role: str, rank: int, api: int, n: int = 1) -> su.Server:
        extra = {"rejoin_timeout_s": REJOIN_TIMEOUT_S} if role == "attention" else {}
        srv = su.Server.start(f"{role}{rank}", model_dir, api, log_dir / f"{role}{rank}_{n}.log",
                              afd_config=su.afd_config(role, rank=rank, **cfg, **extra))  # fmt: skip
        servers.append(srv)
        return srv

    try:
        ffn0, ffn1 = start("ffn", 0, api_f0), start("ffn", 1, api_f1)
        att0, att1 = start("attention", 0, api0), start("attention", 1, api1)
        want = [o["token_ids"] for o in reference.output(START_TIMEOUT_S)["outputs"]]
        print(f"2A2F healthy: {wait_healthy([ffn0, ffn1, att0, att1], START_TIMEOUT_S)}")

        # Both ranks stream; FFN rank 0 dies: rank 0 fails over to FFN rank 1.
        streams = streams_on([att0, att1])
        t_kill = time.monotonic()
        ffn0.kill()
        line = wait_log(att0, "rejoined FFN rank 1", REJOIN_TIMEOUT_S)
        outage = float(re.search(r"after ([0-9.]+) s without it", line).group(1))
        wait_log(ffn1, "took attention rank 0 from", 5)
        assert_complete(streams, want)
        print(f"FFN rank 0 SIGKILLed: attention rank 0 failed over to FFN rank 1 after "
              f"{outage:.2f} s; {len(streams)}/{len(streams)} streams completed with plain "
              "vLLM's tokens")  # fmt: skip
        assert "lost AFD" not in att1.log_path.read_text(errors="replace")  # rank 1 untouched

        # FFN rank 0 comes back: rank 0 moves home, FFN rank 0 serves it again.
        t_start = time.monotonic()
        ffn0 = start("ffn", 0, api_f0, n=2)
        wait_log(att0, "moved back from FFN rank 1", START_TIMEOUT_S)
        t_home = time.monotonic() - t_start
        wait_log(ffn1, "let guest attention rank 0 go", 10)
        # Not /health: its 503 can come from a stale snapshot (see served_so_far).
        before = served_so_far(ffn0, START_TIMEOUT_S)
        streams = streams_on([att0, att1])
        assert_complete(streams, want)
        deadline = time.monotonic() + 15  # the counters reach /metrics every few seconds
        while steps_served(ffn0) <= before:
            assert time.monotonic() < deadline, "rank 0's steps not served by FFN rank 0"
            time.sleep(0.5)
        print(
            f"FFN rank 0 restarted: rank 0 moved home {t_home:.1f} s after the start "
            f"({time.monotonic() - t_kill:.1f} s after the kill); served there again"
        )
        assert all(s.alive() for s in (ffn0, ffn1, att0, att1))
    finally:
        su.stop_servers(servers)
        reference.stop()
        left = {s.name: su.group_members(s.pgid) for s in servers}
        assert not any(left.values()), f"processes left after stop: {left}"
