"""GPU: on cuda_ipc an attention rank that stops mid-stream holds no other rank (2A1F).

Two attention servers (ranks 0 and 1, eager: their hosts enqueue each layer's exchange as
the forward reaches it) and one FFN server serving both, all on GPU 0 (scripts/gpu/run_gpu.sh
runs them under CUDA MPS with MPS=1), connector cuda_ipc. Both stream; attention rank 1's
whole process group is then SIGSTOPped for good. The FFN host waits for each rank's layer
input before it enqueues the receive, so rank 1 is dropped at its own deadline (the FFN's
timeout_s, FFN_TIMEOUT_S, after it began to wait; or silent for FFN_TIMEOUT_S between steps)
and the passes go on for rank 0: its streams never pause longer than STALL_BOUND_S and all
complete. Before, a stop that landed between two layers of a step left the FFN's device
waits on rank 1's flags (up to timeout_s each, one per remaining layer) holding rank 0's
rows of the same pass. Where the stop lands is chance (between steps nothing waits on rank
1): the FFN's reason for dropping rank 1 is printed. The CPU version of the scenario with
gloo: tests/cpu/test_afd_rank_restart.py.

Server logs: the test's tmp dir (attention0.log, attention1.log, ffn.log).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import TokenStream, join_streams, wait_for, wait_healthy, wait_log

import serve_util as su

TEST_TIMEOUT_S = 420
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TEST_TIMEOUT_S)]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HERE = Path(__file__).resolve().parent
MODELS_DIR = Path(os.environ.get("AFD_MODELS_DIR", HERE.parents[1] / "build" / "models"))
MODEL = "deepseek_v2_mla"
ENV = {"CUDA_VISIBLE_DEVICES": su.cuda_visible_devices("0", "0", "cuda_ipc")}
# Three engines on one GPU: each gets a fixed KV cache size (an engine that sizes its cache by
# profiling counts the others' allocations as its own and finds no memory left for it).
GPU_ARGS = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.12", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
            "--no-enable-prefix-caching"]  # fmt: skip
ATTENTION_TIMEOUT_S = 60.0  # the attention servers' (they dial the FFN server as it starts)
FFN_TIMEOUT_S = 1.5  # the FFN server's: a stopped rank's deadline
STALL_BOUND_S = 2.0  # the longest pause of rank 0's streams while rank 1 is stopped
START_TIMEOUT_S = 240.0
PROMPTS = ["Story number 0: once upon a time", "Story number 1: once upon a time",
           "Story number 2: once upon a time"]  # fmt: skip
STREAM_TOKENS = 200


def longest_pause(streams: list[TokenStream], since: float) -> float:
    """The longest time without a token on any of ``streams`` from ``since`` (the gap
    across ``since`` counted) until each ended."""
    worst = 0.0
    for s in streams:
        times = [t for t in s.times if t <= since][-1:] + [t for t in s.times if t > since]
        worst = max([worst, *(b - a for a, b in zip(times, times[1:]))])
    return worst


def test_gpu_ipc_a_stopped_attention_rank_holds_no_other_rank(tmp_path):
    model_dir = MODELS_DIR / MODEL
    assert (model_dir / "model.safetensors").is_file(), f"{model_dir}: run `make models`"
    print(f"server logs: {tmp_path}")
    api0, api1, api_ffn, afd_port = su.free_ports(4)
    cfg = dict(connector="cuda_ipc", num_attention_ranks=2)
    servers: list[su.Server] = []

    def start(name: str, port: int, afd: dict, extra: list[str]) -> su.Server:
        srv = su.Server.start(name, model_dir, port, tmp_path / f"{name}.log", afd_config=afd,
                              python=sys.executable, env=ENV, extra_args=[*GPU_ARGS, *extra],
                              cpu_args=False)  # fmt: skip
        servers.append(srv)
        return srv

    stopped: su.Server | None = None
    try:
        att = [start(f"attention{r}", (api0, api1)[r],
                     su.afd_config("attention", afd_port, rank=r,
                                   timeout_s=ATTENTION_TIMEOUT_S, **cfg),
                     ["--enforce-eager"]) for r in (0, 1)]  # fmt: skip
        for a in att:  # the FFN server's short timeout_s also bounds its wait for them
            wait_log(a, "AFD: connecting to FFN rank 0", START_TIMEOUT_S)
        ffn = start("ffn", api_ffn, su.afd_config("ffn", afd_port, timeout_s=FFN_TIMEOUT_S,
                                                  **cfg), [])  # fmt: skip
        print(f"2A1F healthy: {wait_healthy([ffn, *att], START_TIMEOUT_S)}")
        wait_log(ffn, "accepted attention rank 1 from", 5)

        streams0 = [TokenStream(att[0], p, STREAM_TOKENS) for p in PROMPTS]
        streams1 = [TokenStream(att[1], p, STREAM_TOKENS) for p in PROMPTS[:2]]
        wait_for(lambda: all(len(s.ids) >= 3 for s in streams0 + streams1), 120,
                 "3 tokens on every stream", poll=0.05)  # fmt: skip
        t_stop = time.monotonic()
        os.killpg(att[1].pgid, signal.SIGSTOP)
        stopped = att[1]
        why = wait_log(ffn, "lost attention rank 1", 30)
        dropped = time.monotonic() - t_stop
        running = join_streams(streams0, 240)
        assert not running, [s.prompt for s in running]
        for s in streams0:
            assert s.result["error"] is None and s.result["done"], (s.prompt, s.result)
            assert len(s.ids) == STREAM_TOKENS, (s.prompt, len(s.ids))
        pause = longest_pause(streams0, t_stop)
        print(f"STALLED cuda_ipc 2A1F: attention rank 1 SIGSTOPped; the FFN dropped it "
              f"{dropped:.2f} s later ({why.strip()}); rank 0's longest pause {pause:.2f} s "
              f"(bound {STALL_BOUND_S:g} s, FFN timeout_s {FFN_TIMEOUT_S:g})")  # fmt: skip
        assert pause <= STALL_BOUND_S, pause
        assert ffn.alive() and att[0].alive()
    finally:
        if stopped is not None:  # a stopped group takes no SIGTERM
            os.killpg(stopped.pgid, signal.SIGKILL)
            os.killpg(stopped.pgid, signal.SIGCONT)
        su.stop_servers(servers)
