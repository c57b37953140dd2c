"""Rejoin, FFN side: an attention rank of a 2A1F deployment (`vllm serve` on the CPU: two
attention servers, ranks 0 and 1, and one FFN server serving both) is SIGKILLed while both
stream, and restarted on the same ports; then the restarted rank 1 is SIGSTOPped (its whole
process group) while both stream: STOPS times for STOP_S (then SIGCONT), and for good.

Checked: the FFN server drops rank 1 and serves on; rank 0 never stops - its streams in
flight at the kill complete, and it answers requests while rank 1 is down, all with the
greedy tokens of plain vLLM (``afd_proc.py plain``); the restarted rank 1 is taken again by
the FFN server (a new handshake of the same rank id) and answers with plain vLLM's tokens
(and top-5 logprobs within 1e-4). The times from the kill to the drop and to the
re-accept are printed. Stopped (mid-step, mid-frame, holding its place in the FFN's
passes, or between steps), rank 1 stalls nobody: rank 0's streams never pause longer than
STALL_BOUND_S and end with plain vLLM's tokens; stopped for less than the FFN's timeout_s
rank 1 goes on where it stopped (its streams too end with plain vLLM's tokens), stopped for
good it is dropped at its own deadline (the FFN's timeout_s after its last byte). Before,
the FFN rank waited on a rank stopped mid-step for as long as it was stopped (up to
timeout_s), and rank 0 with it.

The attention servers start first and the FFN server once both dial it, so that the FFN's
timeout_s (the stopped rank's deadline) can be short: it also bounds the FFN's wait for its
ranks at start.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from harness import (
    AfdProc,
    TokenStream,
    afd_metrics,
    join_streams,
    module_log_dir,
    start_plain,
    wait_for,
    wait_healthy,
    wait_log,
)
from oracle_lib import LOGPROB_TOL

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
AFD_TIMEOUT_S = 120.0  # the attention servers' timeout_s (they dial the FFN server as it starts)
FFN_TIMEOUT_S = 10.0  # the FFN server's: a stopped rank is dropped this long after its last byte
STALL_BOUND_S = 2.0  # the longest pause of rank 0's streams while rank 1 is stopped
STOPS, STOP_S, RUN_S = 4, 3.0, 1.0  # rank 1 stopped STOPS times for STOP_S, RUN_S apart
START_TIMEOUT_S = 300.0
STREAM_PROMPTS = ["Story number 0: once upon a time", "Story number 1: once upon a time",
                  "Story number 2: once upon a time"]  # fmt: skip
STREAM_TOKENS = 160
CHECK_PROMPTS = ["Hello, my name is", "The capital of France is"]
CHECK_TOKENS = 12
CHECK_EVERY_S = 5.0  # rank 0's requests while rank 1 restarts
PARAMS = {"temperature": 0.0, "logprobs": 5, "ignore_eos": True,
          "return_tokens_as_token_ids": True}  # fmt: skip


log_dir = module_log_dir("afd_rank_restart_logs")


def plain_reference(model_dir: Path, log_dir: Path) -> AfdProc:
    """Plain vLLM on the streamed and the checked prompts, in a process of its own."""
    return start_plain(model_dir, log_dir, {
        "prompts": STREAM_PROMPTS + CHECK_PROMPTS,
        "max_tokens": [STREAM_TOKENS] * len(STREAM_PROMPTS) + [CHECK_TOKENS] * 2,
    })




def check(srv: su.Server, want: dict[str, dict]) -> None:
    """Greedy completions of CHECK_PROMPTS: plain vLLM's tokens and top-5 logprobs."""
    for prompt in CHECK_PROMPTS:
        status, body = srv.completion(prompt, max_tokens=CHECK_TOKENS, timeout=120, **PARAMS)
        assert status == 200, (srv.name, body)
        choice = su.parse_choice(body)
        assert su.token_ids(choice["tokens"]) == want[prompt]["token_ids"], (srv.name, prompt)
        top = [{k.split(":", 1)[1]: v for k, v in pos.items()} for pos in choice["top_logprobs"]]
        diff = su.max_logprob_diff(top, want[prompt]["logprobs"])
        assert diff <= LOGPROB_TOL, f"{srv.name} {prompt!r}: max |logprob diff| {diff:.3g}"


def longest_pause(streams: list[TokenStream], since: float) -> float:
    """The longest time without a token on any of ``streams`` from ``since`` (the gap
    across ``since`` counted) until each ended."""
    worst = 0.0
    for s in streams:
        times = [t for t in s.times if t <= since][-1:] + [t for t in s.times if t > since]
        worst = max([worst, *(b - a for a, b in zip(times, times[1:]))])
    return worst


def straggler_splits(ffn: su.Server) -> float:
    return sum(v for k, v in afd_metrics(ffn).items()
               if k.startswith("vllm:afd_ffn_straggler_splits_total"))  # fmt: skip


def test_attention_rank_killed_and_restarted_the_other_never_stops(model_dir, log_dir):
    reference = plain_reference(model_dir, log_dir)
    api0, api1, api_ffn, afd_port = su.free_ports(4)
    cfg = dict(port=afd_port, timeout_s=AFD_TIMEOUT_S, num_attention_ranks=2)
    servers: list[su.Server] = []

    def attention(rank: int, n: int) -> su.Server:
        srv = su.Server.start(f"attention{rank}", model_dir, (api0, api1)[rank],
                              log_dir / f"attention{rank}_{n}.log",
                              afd_config=su.afd_config("attention", rank=rank, **cfg))  # fmt: skip
        servers.append(srv)
        return srv

    try:
        att0, att1 = attention(0, 1), attention(1, 1)
        for att in (att0, att1):
            wait_log(att, "AFD: connecting to FFN rank 0", START_TIMEOUT_S)
        ffn = su.Server.start("ffn", model_dir, api_ffn, log_dir / "ffn.log",
                              afd_config=su.afd_config("ffn", **{**cfg,
                                                               "timeout_s": FFN_TIMEOUT_S}))  # fmt: skip
        servers.append(ffn)
        outputs = reference.output(START_TIMEOUT_S)["outputs"]
        want = dict(zip(STREAM_PROMPTS + CHECK_PROMPTS, outputs))
        print(f"2A1F healthy: {wait_healthy([ffn, att0, att1], START_TIMEOUT_S)}")
        accepted = "accepted attention rank 1 from"
        wait_log(ffn, accepted, 5)

        # Both ranks stream (their steps share the FFN's passes); rank 1 dies mid-stream.
        streams0 = [TokenStream(att0, p, STREAM_TOKENS) for p in STREAM_PROMPTS]
        streams1 = [TokenStream(att1, p, STREAM_TOKENS) for p in STREAM_PROMPTS[:2]]
        wait_for(lambda: all(s.ids for s in streams0 + streams1), 120, "a token on every stream",
                 poll=0.05)  # fmt: skip
        t_kill = time.monotonic()
        att1.kill()
        wait_log(ffn, "lost attention rank 1", AFD_TIMEOUT_S)
        print(f"FFN dropped attention rank 1 {time.monotonic() - t_kill:.2f} s after the kill")

        # Restart rank 1; rank 0 serves meanwhile and its streams go on.
        att1 = attention(1, 2)
        served, next_check = 0, 0.0
        while not att1.healthy():
            att1.check_alive()
            assert time.monotonic() - t_kill < START_TIMEOUT_S, "rank 1 did not come back"
            if time.monotonic() >= next_check:  # paced: rank 1's start needs the 2 CPUs too
                check(att0, want)
                served += 1
                next_check = time.monotonic() + CHECK_EVERY_S
            time.sleep(0.5)
        wait_log(ffn, accepted, 5, count=2)
        t_back = time.monotonic() - t_kill
        print(f"attention rank 1 re-accepted and healthy {t_back:.1f} s after the kill; rank 0 "
              f"answered {served} x {len(CHECK_PROMPTS)} requests meanwhile")  # fmt: skip
        check(att1, want)
        check(att0, want)

        running = join_streams(streams0, 240)
        assert not running, [s.prompt for s in running]
        for s in streams0:
            assert s.result["error"] is None and s.result["done"], (s.prompt, s.result)
            assert s.ids == want[s.prompt]["token_ids"], f"rank 0 stream {s.prompt!r}"
        assert not join_streams(streams1, 30)  # the killed server's streams ended (an error)
        assert served >= 1 and ffn.alive() and att0.alive()

        # Both stream again; rank 1 stops (SIGSTOP, its process group) STOPS times for
        # STOP_S and goes on (a stop lands mid-step or between steps), then for good.
        streams0 = [TokenStream(att0, p, STREAM_TOKENS) for p in STREAM_PROMPTS]
        streams1 = [TokenStream(att1, p, STREAM_TOKENS) for p in STREAM_PROMPTS[:2]]
        wait_for(lambda: all(len(s.ids) >= 3 for s in streams0 + streams1), 120,
                 "3 tokens on every stream", poll=0.05)  # fmt: skip
        t_first = time.monotonic()
        for _ in range(STOPS):
            os.killpg(att1.pgid, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.killpg(att1.pgid, signal.SIGCONT)
            time.sleep(RUN_S)
        running = join_streams(streams0 + streams1, 240)
        assert not running, [(s.srv.name, s.prompt) for s in running]
        pause = longest_pause(streams0, t_first)
        print(f"rank 0 while rank 1 stopped {STOPS} x {STOP_S:g} s: longest pause of its "
              f"streams {pause:.2f} s (FFN passes split off the stopped rank: "
              f"{straggler_splits(ffn):g}); rank 1's longest "
              f"{longest_pause(streams1, t_first):.2f} s")  # fmt: skip
        for s in streams0 + streams1:  # rank 1's resumed steps too
            assert s.result["error"] is None and s.result["done"], (s.srv.name, s.result)
            assert s.ids == want[s.prompt]["token_ids"], f"{s.srv.name} stream {s.prompt!r}"
        assert pause <= STALL_BOUND_S, pause
        lost = [ln for ln in ffn.log_path.read_text(errors="replace").splitlines()
                if "lost attention rank 1" in ln]  # fmt: skip
        assert len(lost) == 1, lost[1:]  # the kill's: the stops within its deadline cost none

        # Stopped for good: dropped at its own deadline; rank 0 goes on.
        streams0 = [TokenStream(att0, p, STREAM_TOKENS) for p in STREAM_PROMPTS]
        streams1 = [TokenStream(att1, p, STREAM_TOKENS) for p in STREAM_PROMPTS[:2]]
        wait_for(lambda: all(len(s.ids) >= 3 for s in streams0 + streams1), 120,
                 "3 tokens on every stream", poll=0.05)  # fmt: skip
        t_stop = time.monotonic()
        os.killpg(att1.pgid, signal.SIGSTOP)
        line = wait_log(ffn, "lost attention rank 1", FFN_TIMEOUT_S + 30, count=2)
        t_drop = time.monotonic() - t_stop
        print(f"FFN dropped the stopped attention rank 1 {t_drop:.2f} s after the stop "
              f"({line.split('lost attention rank 1 (', 1)[-1].split(');')[0]})")  # fmt: skip
        # its own deadline: the FFN's timeout_s after its last byte (between steps at most
        # a heartbeat interval, 1 s, before the stop)
        assert FFN_TIMEOUT_S - 1.5 <= t_drop <= FFN_TIMEOUT_S + 5, t_drop
        peer_up = 'vllm:afd_peer_up{afd_rank="0",peer="attention_rank_1",role="ffn"}'
        wait_for(lambda: afd_metrics(ffn).get(peer_up) == 0, 10, f"{peer_up} 0")
        running = join_streams(streams0, 240)
        assert not running, [s.prompt for s in running]
        pause = longest_pause(streams0, t_stop)
        print(f"rank 0 while rank 1 stopped for good: longest pause of its streams "
              f"{pause:.2f} s; its streams ended {max(s.ended_at for s in streams0) - t_stop:.1f}"
              " s after the stop")  # fmt: skip
        for s in streams0:
            assert s.result["error"] is None and s.result["done"], (s.prompt, s.result)
            assert s.ids == want[s.prompt]["token_ids"], f"rank 0 stream {s.prompt!r}"
        assert pause <= STALL_BOUND_S, pause
        check(att0, want)  # after the drop too
        att1.kill()  # stopped: SIGKILL ends it
        assert not join_streams(streams1, 30)
        assert ffn.alive() and att0.alive()
    finally:
        su.stop_servers(servers)
        reference.stop()
        left = {s.name: su.group_members(s.pgid) for s in servers}
        assert not any(left.values()), f"processes left after stop: {left}"
