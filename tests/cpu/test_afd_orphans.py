"""The children of a killed `vllm serve` API server end.

SIGKILL of an AFD server's API server process only (the pid a supervisor, a container
runtime with a custom stop or the OOM killer hits) used to leave its engine core and
worker running: an FFN server's kept serving the attention server and kept the AFD port
bound, and the attention side never noticed. Here both servers run with the engine core
in child processes (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default: there is no child to
orphan otherwise). One test, two pairs on the same ports:

1. the FFN API server is SIGKILLed while a request streams: every process it started is
   gone within ORPHAN_EXIT_S, the AFD port can be bound again, and the attention server
   fails as for a killed FFN (the stream ends with an error, the next request gets a 5xx or
   a refused connection, the server exits 1 naming the lost FFN rank);
2. a new pair; the attention API server is SIGKILLed: its children are gone within
   ORPHAN_EXIT_S and the FFN server drops the lost attention rank within BOUND_S and serves
   on (an FFN rank survives the loss of an attention rank and takes it again later). The
   orphaned engine core may end cleanly (the FFN log says the rank said goodbye) or be cut
   off mid-step (the FFN log says it lost the rank): the race is the kill's, both count.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from harness import TokenStream, join_streams, request_after_peer_loss, wait_for, wait_healthy

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
AFD_TIMEOUT_S = 30.0
BOUND_S = AFD_TIMEOUT_S + 5  # a lost peer must be acted on within timeout_s + 5 s
ORPHAN_EXIT_S = 5.0  # the children of a dead API server must be gone within this
START_TIMEOUT_S = 300.0
MP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_AFD_SECRET": ""}
# The in-flight stream must outlast the killed server's children (up to ORPHAN_EXIT_S): at
# 480 tokens it once ended (about 200 tokens/s on this tiny model) before the FFN worker did
# (2.6 s after the kill), and nothing failed. 2,000 tokens last about 10 s.
STREAM_TOKENS = 2000
LONG_ARGS = ["--max-model-len", "2048"]  # the checkpoint's max_position_embeddings


def rank_dropped(ffn: su.Server) -> str | None:
    """How the FFN server's log says it dropped attention rank 0, or None yet. An orphaned
    attention engine core that was idle shuts down cleanly and says goodbye; one cut off
    mid-step is a lost rank. Either way the FFN rank forgets it and serves on."""
    text = ffn.log_path.read_text(errors="replace")
    if "FFN rank 0 lost attention rank 0 (" in text:
        return "lost"
    if re.search(r"AFD: attention rank 0 at \S+ said goodbye", text):
        return "goodbye"
    return None


class Pair:
    """An attention and an FFN `vllm serve` server on fixed ports (engine cores in child
    processes), restartable."""

    def __init__(self, model_dir: Path, log_dir: Path):
        self.model_dir, self.log_dir = model_dir, log_dir
        self.api_attn, self.api_ffn, self.afd_port = su.free_ports(3)
        self.started: list[su.Server] = []

    def start(self, role: str) -> su.Server:
        n = len(self.started) + 1
        srv = su.Server.start(
            role, self.model_dir, self.api_attn if role == "attention" else self.api_ffn,
            self.log_dir / f"{n:02d}_{role}.log", env=MP_ENV, extra_args=LONG_ARGS,
            # rejoin_timeout_s 0: the attention server ends at once when its FFN is gone
            # (waiting for it is tests/cpu/test_afd_restart.py)
            afd_config=su.afd_config(role, self.afd_port, timeout_s=AFD_TIMEOUT_S,
                                     rejoin_timeout_s=0),
        )  # fmt: skip
        self.started.append(srv)
        return srv

    def start_both(self) -> tuple[su.Server, su.Server]:
        attn, ffn = self.start("attention"), self.start("ffn")
        ready = wait_healthy([attn, ffn], START_TIMEOUT_S)
        print(f"AFD pair healthy after {ready}")
        return attn, ffn


def kill_api_server(srv: su.Server) -> tuple[float, list[psutil.Process]]:
    """SIGKILL to the API server process only; (the time of the kill, the processes it had
    started, listed before the kill)."""
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    names = [c.name() for c in children]
    assert any("EngineCore" in n for n in names), f"{srv.name}: no engine-core child: {names}"
    t_kill = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    return t_kill, children


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def exit_times(children: list[psutil.Process], t_kill: float, timeout: float) -> dict:
    """Seconds from the kill until each child was gone ("name pid" -> s, None: still
    running after ``timeout``)."""
    left = {f"{c.name()} {c.pid}": c for c in children}
    out: dict[str, float | None] = dict.fromkeys(left)
    deadline = t_kill + timeout
    while left and time.monotonic() < deadline:
        for key, c in list(left.items()):
            if not running(c):
                out[key] = round(time.monotonic() - t_kill, 2)
                del left[key]
        time.sleep(0.05)
    return out


def assert_children_gone(srv: su.Server, children, t_kill: float) -> dict:
    times = exit_times(children, t_kill, ORPHAN_EXIT_S)
    print(f"{srv.name} API server SIGKILLed; its children exited after (s): {times}")
    left = [k for k, t in times.items() if t is None]
    assert not left, (
        f"{srv.name}: still running {ORPHAN_EXIT_S:.0f} s after its API server was killed: "
        f"{left}\n{su.log_tail(srv.log_path, 20)}"
    )
    return times


def test_children_of_a_killed_api_server_end(model_dir, tmp_path):
    pair = Pair(model_dir, tmp_path)
    try:
        attn, ffn = pair.start_both()
        stream = TokenStream(attn, "Once upon a time", STREAM_TOKENS, timeout=120)
        wait_for(lambda: stream.ids, 120, "a streamed token")

        # 1. the FFN API server dies: its engine core and worker follow, the port is free
        t_kill, children = kill_api_server(ffn)
        ffn_times = assert_children_gone(ffn, children, t_kill)
        assert su.port_bindable(pair.afd_port), "AFD port still bound"

        # ... and the attention server fails as for a killed FFN server
        assert not join_streams([stream], BOUND_S), "the in-flight stream still runs"
        assert stream.result["error"] and stream.result["finish_reason"] != "length", (
            f"the in-flight stream did not fail: {stream.result}")
        outcome = request_after_peer_loss(attn, BOUND_S)
        print(f"next request to the attention server: {outcome}")
        assert su.wait_for_exit(attn.proc, BOUND_S) is not None, "attention server still up"
        t_attn = time.monotonic() - t_kill
        lost = f"lost AFD peer FFN rank 0 at 127.0.0.1:{pair.afd_port}"
        assert lost in attn.log_path.read_text(errors="replace"), su.log_tail(attn.log_path)
        assert attn.proc.returncode == 1, su.log_tail(attn.log_path)
        print(f"attention server exited {t_attn:.2f} s after the FFN API server kill")

        # 2. a new pair on the same ports: the attention API server dies; its children
        # follow, and the FFN server drops that attention rank and serves on (it takes the
        # rank again when its server comes back: tests/cpu/test_afd_faults.py)
        attn, ffn = pair.start_both()
        t_kill, children = kill_api_server(attn)
        attn_times = assert_children_gone(attn, children, t_kill)
        how = wait_for(lambda: rank_dropped(ffn) or ffn.proc.poll() is not None, BOUND_S,
                       "the FFN server dropping attention rank 0")
        t_ffn = time.monotonic() - t_kill
        assert ffn.proc.poll() is None, su.log_tail(ffn.log_path)  # still serving
        print(f"FFN server dropped the attention rank ({how}) {t_ffn:.2f} s after the "
              "attention API server kill and serves on")
        print(f"figures: FFN children {ffn_times}, attention children {attn_times}")
    finally:
        su.stop_servers(pair.started)  # their process groups hold any orphan left
    left = {s.log_path.name: su.group_members(s.pgid) for s in pair.started}
    assert not any(left.values()), f"processes left: {left}"
    busy = [p for p in (pair.api_attn, pair.api_ffn, pair.afd_port) if not su.port_bindable(p)]
    assert not busy, f"ports still taken: {busy}"
