"""The cuda_ipc connector on its own: two processes on one GPU.

Eager steps and CUDA-graph replays of a three-layer exchange return exactly
what the FFN process computed, also for DBO steps (two micro-batch slots, each
exchange on its own stream) and for a global-mode capture that lasts longer
than the watchdog's period (graph_capture_guard); a stalled FFN process and a
killed one both end in the attention side's failure callback within a bounded
time. With two attention ranks, one rank that sets its own error word on the
FFN rank ends its own session only, and can join again; a buffer description
of the wrong size is refused with the field named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

import serve_util as su

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HIDDEN = 256
LAYERS = 3
MAX_TOKENS = 128
TIMEOUT_S = 3.0


def _free_port() -> int:
    return su.free_port()


def _ctx(role: str, port: int, rank: int = 0, m: int = 1, **keys):
    from vllm.afd.protocol import FINGERPRINT_KEYS, PROTOCOL_VERSION
    from vllm.config.afd import AFDConfig
    from vllm.distributed.afd.base import ConnectorContext

    cfg = AFDConfig.from_dict({"role": role, "connector": "cuda_ipc", "port": port,
                               "timeout_s": TIMEOUT_S, "num_attention_ranks": m,
                               **keys})  # fmt: skip
    fp = {k: "x" for k in FINGERPRINT_KEYS}
    fp.update(protocol=PROTOCOL_VERSION, hidden_size=HIDDEN, dtype="bfloat16",
              ffn_layers=list(range(LAYERS)), connector="cuda_ipc",
              num_attention_ranks=m, num_ffn_ranks=1, compute_gate_on_attention=False,
              max_num_tokens=MAX_TOKENS, afd_revision="test")  # fmt: skip
    # "cuda" without an index, as vLLM's device config gives it
    return ConnectorContext(cfg, rank, fp, MAX_TOKENS, torch.device("cuda"))


def _ffn_main(port: int, stall_after: int, ready, m: int = 1, die_after: int = 1 << 30) -> None:
    from vllm.distributed.afd.base import create_ffn_connector

    torch.cuda.set_device(0)
    conn = create_ffn_connector(_ctx("ffn", port, m=m))
    conn.start()
    ready.set()
    from vllm.afd.protocol import ubatch_of
    from vllm.distributed.afd.base import StepPeer

    served = 0
    while True:
        steps = conn.wait_step(timeout=0.2)
        for peer in steps:
            if served >= stall_after:
                time.sleep(3600)  # alive, never answers
            # A DBO step: its micro-batches layer by layer, as the FFN runner does.
            peers = [peer] + [StepPeer(peer.rank, conn.recv_control(peer))
                              for _ in range(1, ubatch_of(peer.control.flags)[1])]
            xs = [torch.empty((p.control.num_tokens, HIDDEN), dtype=torch.bfloat16,
                              device="cuda") for p in peers]
            for layer in range(LAYERS):
                for p, x in zip(peers, xs):
                    conn.recv(p, x)
                    if served >= die_after and layer == 1:
                        torch.cuda.synchronize()
                        os._exit(1)  # gone in the middle of the step, as under SIGKILL
                    conn.send(p, x * 2 + layer)
            served += 1


def _reference(x: torch.Tensor) -> torch.Tensor:
    for layer in range(LAYERS):
        x = x * 2 + layer
    return x


class _Pair:
    """The FFN process and ``m`` attention ranks (connectors of this process)."""

    def __init__(self, stall_after: int = 1 << 30, m: int = 1):
        # Everything slow first (imports, CUDA start): the FFN process waits
        # only timeout_s for this side.
        torch.zeros(1, device="cuda")
        self.port = _free_port()
        self.m = m
        # Per rank: (time, message) of each failure its watchdog reported.
        self.failed: dict[int, list[tuple[float, str]]] = {r: [] for r in range(m)}
        self.failures = self.failed[0]
        self.conns = [self.attention(r) for r in range(m)]
        self.conn = self.conns[0]
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self.ffn = ctx.Process(target=_ffn_main, args=(self.port, stall_after, ready, m),
                               daemon=True)  # fmt: skip
        self.ffn.start()
        assert ready.wait(120), "FFN process did not start"
        for c in self.conns:
            c.connect()

    def attention(self, rank: int):
        from vllm.distributed.afd.base import create_attention_connector

        conn = create_attention_connector(_ctx("attention", self.port, rank, self.m))
        conn.on_failure = lambda msg: self.failed[rank].append((time.monotonic(), msg))
        return conn

    def step(self, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
        conn = self.conns[rank]
        conn.begin_step(0, x.shape[0])
        h = x
        for _ in range(LAYERS):
            conn.send(h)
            h = conn.recv(torch.empty_like(h))
        return h

    def dbo_step(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One DBO step of two micro-batches, in the order vLLM's micro-batch
        threads run them (hand-over at each exchange), from one thread: the
        connector finds its slot through vLLM's micro-batch id of the thread."""
        import threading

        from vllm.v1.worker import ubatching

        me = threading.get_ident()
        tokens = [x.shape[0] for x in xs]
        hs, waits = list(xs), [None, None]
        try:
            for layer in range(LAYERS):
                for i in range(2):
                    ubatching._THREAD_ID_TO_CONTEXT[me] = i
                    if waits[i] is not None:
                        hs[i] = waits[i]()  # this micro-batch resumes
                    if layer == 0:
                        self.conn.begin_step(0, tokens[i], ubatch=(i, 2), ubatch_tokens=tokens)
                    self.conn.send(hs[i])
                    waits[i] = self.conn.recv_start(torch.empty_like(hs[i]))
            out = []
            for i in range(2):
                ubatching._THREAD_ID_TO_CONTEXT[me] = i
                out.append(waits[i]())
            return out
        finally:
            ubatching._THREAD_ID_TO_CONTEXT.pop(me, None)

    def wait_failure(self, bound: float) -> str:
        t0 = time.monotonic()
        while not self.failures and time.monotonic() - t0 < bound:
            time.sleep(0.05)
        assert self.failures, f"no failure reported within {bound} s"
        return self.failures[0][1]

    def close(self) -> None:
        for c in self.conns:
            c._closed.set()
        if self.ffn.is_alive():
            os.kill(self.ffn.pid, signal.SIGKILL)
        self.ffn.join(10)


@pytest.fixture
def pair():
    made: list[_Pair] = []

    def make(**kw) -> _Pair:
        made.append(_Pair(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_eager_and_graph_replay_exact(pair):
    p = pair()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 7, 64, MAX_TOKENS):  # eager, several sizes
        x = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        assert torch.equal(p.step(x), _reference(x)), n
    for n in (4, 33):
        static = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        p.step(static)  # warm-up of this size
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = p.step(static)
        for _ in range(20):
            x = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, _reference(x)), n
        # Eager steps still interleave with replays (device counters agree).
        x = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        assert torch.equal(p.step(x), _reference(x))
    torch.cuda.synchronize()
    assert not p.failures


def test_stalled_ffn_fails_within_timeout(pair):
    p = pair(stall_after=2)
    x = torch.ones((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        assert torch.equal(p.step(x), _reference(x))
    t0 = time.monotonic()
    p.step(x)  # never answered: the device wait gives up after timeout_s
    msg = p.wait_failure(TIMEOUT_S + 5)
    elapsed = p.failures[0][0] - t0
    assert "did not answer within the timeout" in msg, msg
    assert TIMEOUT_S - 0.5 <= elapsed <= TIMEOUT_S + 2, elapsed
    torch.cuda.synchronize()  # the stream is not stuck
    print(f"stalled FFN: failure reported {elapsed:.2f} s after the step (timeout_s {TIMEOUT_S})")


def test_killed_ffn_fails_fast(pair):
    p = pair()
    x = torch.ones((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(p.step(x), _reference(x))
    t0 = time.monotonic()
    os.kill(p.ffn.pid, signal.SIGKILL)
    msg = p.wait_failure(5)
    elapsed = p.failures[0][0] - t0
    assert "lost AFD peer" in msg, msg
    assert elapsed < 2, elapsed
    print(f"killed FFN: failure reported {elapsed:.2f} s after SIGKILL")


def test_dbo_steps_use_one_slot_and_stream_per_micro_batch(pair):
    p = pair()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n0, n1 in ((1, 1), (2, 1), (32, 32), (64, 63)):  # eager
        xs = [torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
              for n in (n0, n1)]
        out = p.dbo_step(xs)
        assert all(torch.equal(o, _reference(x)) for o, x in zip(out, xs)), (n0, n1)
        x = torch.randn((n0 + n1, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        assert torch.equal(p.step(x), _reference(x))  # a step that is not micro-batched
    static = [torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
              for n in (4, 3)]
    p.dbo_step(static)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # both micro-batches in one graph, as vLLM's wrapper does
        out = p.dbo_step(static)
    for _ in range(10):
        xs = [torch.randn(s.shape, dtype=torch.bfloat16, device="cuda", generator=gen)
              for s in static]
        for s, x in zip(static, xs):
            s.copy_(x)
        graph.replay()
        assert all(torch.equal(o, _reference(x)) for o, x in zip(out, xs))
    torch.cuda.synchronize()
    assert not p.failures


def test_a_long_global_mode_capture_survives_the_watchdog(pair):
    """vLLM captures in global mode; the watchdog probes the device every 0.1 s
    from its own thread. Inside graph_capture_guard (patch graph-capture-guard puts vLLM's
    capture_model there) a capture lasting many probe periods succeeds."""
    from vllm.afd.attention import graph_capture_guard

    p = pair()
    static = torch.randn((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    p.step(static)
    graph = torch.cuda.CUDAGraph()
    with graph_capture_guard(), torch.cuda.graph(graph):  # capture_error_mode "global"
        h = p.step(static)
        time.sleep(0.6)  # six watchdog periods
        out = p.step(h)
    x = torch.randn((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    static.copy_(x)
    graph.replay()
    assert torch.equal(out, _reference(_reference(x)))
    time.sleep(0.3)  # the watchdog probes the device again, without failures
    torch.cuda.synchronize()
    assert not p.failures and p.conn._watch.is_alive()



def test_a_ranks_error_word_ends_only_its_own_session(pair, monkeypatch):
    """Each attention rank has its own control buffer (control row, data flags, error
    word) on the FFN rank, alone in its segment. Rank 0 writing its error word (as
    when the FFN waited in vain for its data, or as a rank gone rogue) ends rank 0's
    session: its FFN connection closes; rank 1 is served on. A rank 0 that joins
    again with a buffer description of the wrong size is refused, naming the field,
    before anything is mapped; one that joins again properly is served."""
    from vllm.afd.protocol import AFDPeerError
    from vllm.distributed.afd import cuda_ipc as ipc

    p = pair(m=2)
    x = torch.randn((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    for rank in (0, 1):
        assert torch.equal(p.step(x, rank), _reference(x)), rank
    ctrls = [c.ctrl.data_ptr() for c in p.conns]
    assert ctrls[0] != ctrls[1]
    assert all(ipc.mapped_range(c) == (c, 2 << 20) for c in ctrls), ctrls
    p.conns[0].ctrl[ipc.ERR_ROW, 0] = 1
    torch.cuda.synchronize()
    msg = p.wait_failure(5)  # the FFN rank dropped rank 0 before it closed the socket
    assert msg == f"lost AFD peer {p.conns[0].peer}: connection closed", msg
    for _ in range(3):
        assert torch.equal(p.step(x, 1), _reference(x))
    assert p.failed[1] == [] and p.ffn.is_alive()
    p.conns[0].close()

    real = ipc.export_buffer

    def oversize(t):
        d = real(t)
        d["storage_bytes"] += 1 << 20  # past the end of the buffer
        return d

    with monkeypatch.context() as m:
        m.setattr(ipc, "export_buffer", oversize)
        with pytest.raises(AFDPeerError, match=r"could not map this rank's buffers: cannot "
                           r"map buffers: bad CUDA IPC description of the peer's flag row: "
                           r"'storage_bytes' is 1048640, this side needs 64"):
            p.attention(0).connect()  # fmt: skip
    assert torch.equal(p.step(x, 1), _reference(x))
    # A proper new session of rank 0: its buffers on the FFN rank start clean.
    p.conns[0] = p.attention(0)
    p.conns[0].connect()
    y = torch.randn((5, HIDDEN), dtype=torch.bfloat16, device="cuda")
    for rank in (0, 1):
        assert torch.equal(p.step(y, rank), _reference(y)), rank
    torch.cuda.synchronize()
    assert p.failed[1] == [] and len(p.failed[0]) == 1


def test_a_rank_lost_abruptly_ends_only_its_session_and_rejoins(pair):
    """Rejoin, FFN side: attention rank 0's connection is reset (its server was
    SIGKILLed). The FFN rank drops rank 0 alone (its device waits released) and serves
    rank 1 on; rank 0's restarted server handshakes again with the same rank id, gets
    fresh buffers on the FFN rank, and both ranks' steps are exact."""
    import socket
    import struct

    from vllm.afd.protocol import AFDHandshakeError

    p = pair(m=2)
    x = torch.randn((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    for rank in (0, 1):
        assert torch.equal(p.step(x, rank), _reference(x)), rank
    torch.cuda.synchronize()
    old = p.conns[0]
    old.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    old.sock.close()  # RST, as the kernel sends for a killed process
    for _ in range(3):
        assert torch.equal(p.step(x, 1), _reference(x))
    assert p.ffn.is_alive() and p.failed[1] == []
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while True:  # the FFN rank refuses rank 0 until it has dropped the old session
        again = p.attention(0)
        try:
            again.connect()
            break
        except AFDHandshakeError as e:
            again._closed.set()
            assert "already connected" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.05)
    p.conns[0] = again
    old._closed.set()
    y = torch.randn((5, HIDDEN), dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        for rank in (0, 1):
            assert torch.equal(p.step(y, rank), _reference(y)), rank
    torch.cuda.synchronize()
    assert p.failed[1] == [] and p.ffn.is_alive()


# --------------------------------------------- rejoin (connector_extra_config.ipc_rejoin)
REJOIN_WINDOW_S = 120.0  # room for a new FFN process to start (spawn, CUDA, triton)


class _RejoinPair(_Pair):
    """One attention rank with ipc_rejoin on, and an FFN process that dies in the
    middle of step ``die_after`` (counted from 0, at its second layer) and can be
    replaced by a new one on the same port."""

    def __init__(self, die_after: int):
        torch.zeros(1, device="cuda")
        self.port = _free_port()
        self.m = 1
        self.failed = {0: []}
        self.failures = self.failed[0]
        self.conns = [self.attention(0)]
        self.conn = self.conns[0]
        self.ffn, ready = self.start_ffn(die_after)
        assert ready.wait(120), "FFN process did not start"
        self.conn.connect()

    def attention(self, rank: int):
        from vllm.distributed.afd.base import create_attention_connector

        ctx = _ctx("attention", self.port, rank, self.m, rejoin_timeout_s=REJOIN_WINDOW_S,
                   connector_extra_config={"ipc_rejoin": True})  # fmt: skip
        conn = create_attention_connector(ctx)
        conn.on_failure = lambda msg: self.failed[rank].append((time.monotonic(), msg))
        return conn

    def start_ffn(self, die_after: int = 1 << 30):
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=_ffn_main, args=(self.port, 1 << 30, ready, 1, die_after),
                           daemon=True)  # fmt: skip
        proc.start()
        return proc, ready

    def restart_when_gone(self, delay: float):
        """In a thread: once the FFN process has ended, wait ``delay`` s and start
        a new one on the same port (the attention rank meanwhile holds its step)."""
        import threading

        started: dict = {}

        def run():
            self.ffn.join(60)
            started["gone"] = time.monotonic()
            time.sleep(delay)
            self.ffn, ready = self.start_ffn()
            started["ready"] = ready.wait(120)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, started


@pytest.fixture
def rejoin_pair():
    made: list[_RejoinPair] = []

    def make(die_after: int) -> _RejoinPair:
        made.append(_RejoinPair(die_after))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_ipc_rejoin_graph_replay_reruns_whole_across_an_ffn_restart(rejoin_pair):
    """Rejoin on cuda_ipc (opt-in ipc_rejoin): a full CUDA graph of the step (as
    FULL_DECODE_ONLY captures the decode forward) is replayed under
    vllm.afd.rejoin.run_forward. The FFN process dies in the middle of a replay
    (after the second layer's data arrived) and a new one starts on the same port
    2 s later: the attention rank neither ends nor waits out timeout_s on the dead
    process's flags, it rejoins, and the same graph - reaching the new process's
    buffers through the pointer table - re-runs the whole step with the exact
    output; later replays and eager steps are exact too. Then the new FFN process
    is SIGKILLed between steps and replaced again: the next replay is re-run the
    same way."""
    from vllm.afd import rejoin

    # The FFN process serves the eager step (its step 0), the warm-up (1) and three
    # replays (2-4; the capture reaches it not); it dies in its step 5.
    p = rejoin_pair(die_after=5)
    conn = p.conn
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn((8, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
    assert torch.equal(rejoin.run_forward(conn, lambda: p.step(x)), _reference(x))  # served 0
    static = torch.randn((8, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
    p.step(static)  # warm-up (served 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured: the FFN rank sees no step
        out = p.step(static)
    table = conn.table.data_ptr()
    passes: list[float] = []

    def replay():
        passes.append(time.monotonic())
        graph.replay()
        return out

    def replay_exact(tag: str) -> None:
        x = torch.randn(static.shape, dtype=torch.bfloat16, device="cuda", generator=gen)
        static.copy_(x)
        got = rejoin.run_forward(conn, replay)
        assert torch.equal(got, _reference(x)), tag

    for i in range(3):  # served 2, 3, 4
        replay_exact(f"replay {i}")
    assert len(passes) == 3
    # The next replay (served 5) loses the FFN process at its second layer.
    restarter, started = p.restart_when_gone(delay=2.0)
    t0 = time.monotonic()
    replay_exact("the replay that lost its FFN rank, re-run")
    resumed = time.monotonic() - t0
    restarter.join(5)
    assert started.get("ready"), "the new FFN process did not start"
    assert len(passes) == 5, "the interrupted replay was not re-run exactly once"
    assert p.failures == [], p.failures  # held, not ended
    assert conn.table.data_ptr() == table and conn.is_up()
    for i in range(3):
        replay_exact(f"replay {i} after the rejoin")
        x = torch.randn((5, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        assert torch.equal(rejoin.run_forward(conn, lambda x=x: p.step(x)), _reference(x))
    print(f"cuda_ipc rejoin: the interrupted replay re-ran clean {resumed:.2f} s after it "
          f"started (new FFN process 2 s after the loss)")  # fmt: skip
    # Killed between steps: the watchdog holds the loss; the next replay runs on the
    # released flags, is found lost, and re-runs once the next process is up.
    restarter, started = p.restart_when_gone(delay=1.0)
    os.kill(p.ffn.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while conn.is_up() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not conn.is_up(), "the loss was not noticed between steps"
    n = len(passes)
    replay_exact("the first replay after a loss between steps")
    restarter.join(5)
    assert len(passes) == n + 2 and p.failures == []
    torch.cuda.synchronize()


def test_ipc_rejoin_off_by_default_still_ends_the_rank(pair):
    """Without ipc_rejoin nothing changed: the graphs write the FFN rank's mapped
    buffers directly (no pointer table) and a killed FFN process ends the rank."""
    p = pair()
    assert p.conn.reruns_forward is False and p.conn.table is None
    x = torch.ones((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(p.step(x), _reference(x))
    os.kill(p.ffn.pid, signal.SIGKILL)
    assert "lost AFD peer" in p.wait_failure(5)
