"""Rejoin of a lost FFN rank on the attention side: the rejoin_timeout_s key,
the connector's reconnect (same address, backoff, deadline, re-handshake), the metrics of an
outage, and the attention client re-running an interrupted step over real TCP connectors
(an FFN rank closed mid-step and a new one started on its port)."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
import types

import pytest
import torch
from tcp_lib import HIDDEN, HOST, MAX_TOKENS, Bg, fingerprint, wait_until

import serve_util as su
from serve_util import free_port
from vllm.afd import failure, metrics, rejoin
from vllm.afd.attention import AttentionClient
from vllm.afd.protocol import AFDHandshakeError, AFDPeerError
from vllm.config.afd import AFDConfig, AFDConfigError
from vllm.distributed.afd import tcp
from vllm.distributed.afd.base import ConnectorContext

TIMEOUT = 2.0


def ctx(
    role: str,
    port: int,
    rejoin_timeout_s=None,
    num_router_logits=None,
    rank=0,
    m=1,
    n=1,
    extra=None,
    timeout=TIMEOUT,
    **fp_changes,
) -> ConnectorContext:
    raw = {"role": role, "connector": "tcp", "host": HOST, "port": port, "timeout_s": timeout,
           "num_attention_ranks": m, "num_ffn_ranks": n, "connector_extra_config": extra or {}}  # fmt: skip
    if rejoin_timeout_s is not None:
        raw["rejoin_timeout_s"] = rejoin_timeout_s
    return ConnectorContext(
        config=AFDConfig.from_dict(raw),
        rank=rank,
        fingerprint=fingerprint(num_attention_ranks=m, num_ffn_ranks=n, **fp_changes),
        max_num_tokens=MAX_TOKENS,
        device=torch.device("cpu"),
        num_router_logits=num_router_logits,
    )


# ------------------------------------------------------------------------------ config
def test_rejoin_timeout_defaults_to_timeout_s_and_zero_turns_it_off():
    assert AFDConfig.from_dict({"role": "attention", "timeout_s": 7}).rejoin_window_s == 7.0
    cfg = AFDConfig.from_dict({"role": "attention", "rejoin_timeout_s": 0})
    assert cfg.rejoin_window_s == 0.0
    assert AFDConfig.from_dict({"role": "ffn", "rejoin_timeout_s": 2.5}).rejoin_window_s == 2.5


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, r"'rejoin_timeout_s' must be a finite number of seconds >= 0 .*; got -1"),
        (math.inf, r"'rejoin_timeout_s' must be a finite number of seconds >= 0 .*; got inf"),
        (math.nan, r"'rejoin_timeout_s' must be a finite number of seconds >= 0 .*; got nan"),
        ("60", r"'rejoin_timeout_s' must be a number of seconds \(0 turns rejoining off.*'60'"),
        (True, r"'rejoin_timeout_s' must be a number of seconds .*got True"),
    ],
)
def test_rejoin_timeout_is_validated(value, message):
    with pytest.raises(AFDConfigError, match=message):
        AFDConfig.from_dict({"role": "attention", "rejoin_timeout_s": value})


def test_a_rejoin_window_past_the_executor_timeout_is_warned():
    def warning(raw, env):
        return AFDConfig.from_dict(raw).rejoin_warning(env)

    assert warning({"role": "attention", "timeout_s": 60}, {}) is None
    msg = warning({"role": "attention", "rejoin_timeout_s": 300}, {})
    assert "is not below VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s)" in msg
    assert warning({"role": "attention", "rejoin_timeout_s": 300},
                   {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "900"}) is None  # fmt: skip
    assert warning({"role": "ffn", "rejoin_timeout_s": 900}, {}) is None


# --------------------------------------------------------------------------- the FFN side
class FakeFFN:
    """A TCP FFN rank on ``port`` whose layers double their input (``layers`` per step);
    it records the inputs it received per step."""

    def __init__(self, port: int, layers: int, gated_width: int = 0, **kw):
        self.conn = tcp.TCPFFNConnector(ctx("ffn", port, **kw))
        self.layers = layers
        # > 0: every layer also receives router logits of this width (gate on attention)
        self.gated_width = gated_width
        self.steps: list[tuple[int, list[torch.Tensor]]] = []
        self.logits: list[torch.Tensor] = []
        self.running = threading.Event()  # cleared: the serve loop pauses
        self.running.set()
        self._stop = threading.Event()
        self.conn.start()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.running.wait(0.05):
                continue
            try:
                peers = self.conn.wait_step(0.05)
                for p in peers:
                    n = p.control.num_tokens
                    seen = []
                    for _ in range(self.layers):
                        buf = torch.empty(n, HIDDEN)
                        self.conn.recv(p, buf)
                        seen.append(buf.clone())
                        if self.gated_width:
                            logits = torch.empty(n, self.gated_width)
                            self.conn.recv(p, logits)
                            self.logits.append(logits)
                        self.conn.send(p, 2 * buf)
                    self.steps.append((p.control.step_id, seen))
            except (AFDPeerError, OSError, ValueError):
                if self._stop.is_set():
                    return
                time.sleep(0.01)

    def close(self) -> None:
        """The FFN rank dies: listener and connections closed (EOF at the attention)."""
        self._stop.set()
        # As a process that dies: the listener goes at once (close() alone leaves it to
        # the accept thread's current accept() call, up to 0.5 s).
        with contextlib.suppress(OSError):
            self.conn.listener.shutdown(socket.SHUT_RDWR)
        for p in list(self.conn.peers.values()):  # wakes a receive blocked on it
            with contextlib.suppress(OSError):
                p.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.thread.join(5)


@pytest.fixture
def ffns():
    made: list[FakeFFN] = []

    def make(port, layers=3, gated_width=0, **kw):
        f = FakeFFN(port, layers, gated_width, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@pytest.fixture
def attention():
    made: list[tcp.TCPAttentionConnector] = []

    def make(port, **kw):
        a = tcp.TCPAttentionConnector(ctx("attention", port, **kw))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


@pytest.fixture
def connected(ffns, attention):
    """make(layers, rejoin_timeout_s): an FFN rank on a free port and an attention connector
    connected to it: (port, the FFN rank, the connector)."""

    def make(layers: int = 1, rejoin_timeout_s: float = 0.0):
        port = free_port()
        ffn = ffns(port, layers=layers)
        att = attention(port, rejoin_timeout_s=rejoin_timeout_s)
        Bg(att.connect).get()
        return port, ffn, att

    return make


def _lose(att: tcp.TCPAttentionConnector) -> None:
    """Wait until the attention side has noticed the loss (its heartbeat)."""
    wait_until(lambda: not att.is_up(), 5.0, "the loss noticed")


# --------------------------------------------------------------------- reconnect itself
def test_reconnect_reaches_a_restarted_ffn_and_counts_the_outage(ffns, connected):
    port, first, att = connected(1, 0)  # no background rejoin: the test drives it
    first.close()
    _lose(att)
    assert att.lost_at() is not None
    before = dict(metrics.STATS.counters)
    later = Bg(lambda: (time.sleep(0.5), ffns(port, layers=1))[1])
    t0 = time.monotonic()
    att.reconnect(time.monotonic() + 10)
    took = time.monotonic() - t0
    second = later.get()
    assert att.is_up() and att.lost_at() is None
    assert 0.4 < took < 3.0, took
    assert metrics.STATS.counters["rejoins"] == before["rejoins"] + 1
    assert metrics.STATS.counters["outage_seconds"] >= before["outage_seconds"] + 0.4
    # the new connection carries a step (a step id the new FFN rank has not seen is fine)
    att.begin_step(50, 2)
    x = torch.randn(2, HIDDEN)
    att.send(x)
    assert torch.equal(att.recv(torch.empty(2, HIDDEN)), 2 * x)
    att.end_step()
    wait_until(lambda: second.steps, 5.0, "the step served")
    att.reconnect(time.monotonic() + 1)  # up: a no-op
    assert att.is_up()


def test_reconnect_gives_up_at_the_deadline(connected):
    port, first, att = connected(1, 0)
    first.close()
    _lose(att)
    t0 = time.monotonic()
    with pytest.raises(AFDPeerError, match=rf"could not reach AFD FFN rank 0 at {HOST}:{port}"):
        att.reconnect(time.monotonic() + 1.0)
    assert 0.9 < time.monotonic() - t0 < 2.5
    assert not att.is_up()


class RacyClosed(threading.Event):
    """The connector's closed flag; ``hook`` runs once at the next is_set() (after the
    flag was read): a close() that lands right after reconnect checked it."""

    hook = None

    def is_set(self) -> bool:
        was = super().is_set()
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return was


def test_close_during_a_reconnect_leaves_no_live_session(ffns, attention):
    """close() (the engine stops) while a reconnect has its new connection: the connector
    ends closed with no session, and the FFN rank frees the slot at once (goodbye or EOF).
    Before: reconnect checked the closed flag, then installed the connection under the
    lock; a close() between the two found no socket to close, and the closed connector
    kept a live session (no heartbeat any more: the FFN rank kept the rank's slot for
    timeout_s, refusing its restarted server as 'already connected')."""
    port = free_port()
    first = ffns(port, layers=1, timeout=30.0)
    att = attention(port, rejoin_timeout_s=0, timeout=30.0)
    att._closed = racy = RacyClosed()
    Bg(att.connect).get()
    first.close()
    _lose(att)
    second = ffns(port, layers=1, timeout=30.0)
    closing: list[Bg] = []

    def close_now():
        closing.append(Bg(att.close))
        closing[0].join(1.0)  # done at once unless it waits for the connector's lock

    racy.hook = close_now
    with contextlib.suppress(AFDPeerError):
        att.reconnect(time.monotonic() + 10)
    closing[0].get(10)
    assert att.sock is None, "a closed connector holds a live session"
    wait_until(lambda: 0 not in second.conn.peers, 5.0, "the FFN rank freed the rank's slot")


def test_close_during_a_move_back_home_leaves_no_live_session(ffns, attention, monkeypatch):
    """The same race on the way back home (failover): close() lands while the heartbeat
    thread has its new connection to the home FFN rank. Before: the move installed it in
    the closed connector."""
    port = su.free_ports(2, consecutive=True)[0]
    topo = dict(m=2, n=2, timeout=30.0, extra={"ffn_failover": True})
    first = ffns(port, layers=1, rank=0, **topo)
    ffns(port, layers=1, rank=1, **topo)
    att = attention(port, rejoin_timeout_s=20, **topo)
    Bg(att.connect).get()
    client = client_for(att, 1)
    first.close()
    x = torch.randn(2, HIDDEN)
    assert torch.equal(client.exchange(x, 0), 2 * x)  # failed over to FFN rank 1
    real_dialer = att._dialer
    closing: list[Bg] = []

    def dialer(ffn_rank):
        home = real_dialer(ffn_rank)
        real_establish = home._establish

        def establish(*args, **kwargs):
            sock = real_establish(*args, **kwargs)
            closing.append(Bg(att.close))
            closing[0].join(1.0)
            return sock

        home._establish = establish
        return home

    monkeypatch.setattr(att, "_dialer", dialer)
    home = ffns(port, layers=1, rank=0, **topo)
    wait_until(lambda: closing, 8.0, "a try home")
    closing[0].get(10)
    time.sleep(0.5)  # the heartbeat thread's move, if any, is done
    assert att.sock is None, "a closed connector holds a live session"
    wait_until(lambda: 0 not in home.conn.peers, 5.0, "the home FFN rank freed the slot")


def test_reconnect_to_another_deployment_fails_at_once(ffns, connected):
    """A restarted FFN rank of another checkpoint: the re-handshake refuses it at once,
    not at the deadline."""
    port, first, att = connected(1, 0)
    first.close()
    _lose(att)
    ffns(port, layers=1, checkpoint="ffffffffffffffffffffffff (other)")
    t0 = time.monotonic()
    with pytest.raises(AFDHandshakeError, match="fingerprint mismatch on 'checkpoint'"):
        att.reconnect(time.monotonic() + 20)
    assert time.monotonic() - t0 < 5


def test_dial_backs_off_doubling_up_to_one_second(monkeypatch, attention):
    """The rejoin dial: 0.1 s, then doubling, at most 1 s between tries, never past the
    deadline (a fake clock: no real waiting)."""
    clock = {"t": 1000.0}
    sleeps: list[float] = []

    def sleep(s):
        sleeps.append(round(s, 3))
        clock["t"] += s

    fake_time = types.SimpleNamespace(monotonic=lambda: clock["t"], sleep=sleep)

    def refuse(*a, **k):
        raise ConnectionRefusedError("nothing listens")

    monkeypatch.setattr(tcp, "time", fake_time)
    monkeypatch.setattr(tcp.socket, "create_connection", refuse)
    att = attention(free_port())
    with pytest.raises(AFDPeerError, match="could not reach"):
        att._dial(1000.0 + 4.5, tcp.REJOIN_BACKOFF_S)
    assert sleeps == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert round(sum(sleeps), 3) == 4.5  # the last sleep ends at the deadline


def test_idle_loss_rejoins_in_the_background(ffns, connected):
    """Lost between steps (the heartbeat sees it): the connector reconnects by itself, so
    that a restarted FFN rank finds its attention rank without waiting for a request."""
    port, first, att = connected(1, 10)
    first.close()
    _lose(att)
    second = ffns(port, layers=1)
    wait_until(att.is_up, 8.0, "the background rejoin")
    wait_until(lambda: 0 in second.conn.peers, 5.0, "the FFN rank accepted the rank")


def test_an_idle_loss_past_the_window_ends_the_engine_with_the_named_error(
    ffns, connected, tmp_path, monkeypatch
):
    """Lost between steps and still away when rejoin_timeout_s has passed: the background
    rejoin gives up at the window's end with the error a held step gets, records it for the
    clients' error (vllm.afd.failure) and calls on_failure, which the attention role sets to
    end the process. Before: it gave up silently - no record, the engine left waiting for
    good, /health 503 "held until it rejoins", and an FFN rank restarted later never joined
    (it ended at its own start-up timeout_s, again and again). An FFN rank started after the
    window is not joined now either: the next step fails at once with the same error."""
    mdir = tmp_path / "afd-metrics"
    mdir.mkdir(mode=0o700)
    monkeypatch.setenv("VLLM_AFD_METRICS_DIR", str(mdir))
    port, first, att = connected(1, 1.0)
    ended: list[tuple[float, str]] = []
    done = threading.Event()
    att.on_failure = lambda msg: (ended.append((time.monotonic(), msg)), done.set())
    client = client_for(att, 1)
    first.close()
    _lose(att)
    lost = att.lost_at()
    assert done.wait(6.0), "the rejoin window passed and nothing ended (no bounded outcome)"
    took = ended[0][0] - lost
    print(f"window 1 s: the engine is ended {took:.2f} s after the loss")
    assert 0.95 <= took < 2.5, took
    msg = ended[0][1]
    assert msg.startswith(f"lost AFD peer FFN rank 0 at {HOST}:{port}"), msg
    assert "; it did not come back within rejoin_timeout_s=1 (could not reach AFD FFN" in msg
    assert failure.failure_of_this_server() == failure.clean_message(msg)
    second = ffns(port, layers=1)  # back after the window
    t0 = time.monotonic()
    with pytest.raises(AFDPeerError, match="did not come back within rejoin_timeout_s=1"):
        client.exchange(torch.randn(2, HIDDEN), 0)
    assert time.monotonic() - t0 < 1.0
    time.sleep(1.0)  # two heartbeats: no rejoin is tried any more
    assert 0 not in second.conn.peers and not att.is_up()
    assert len(ended) == 1


def test_the_attention_role_has_a_give_up_end_the_process(monkeypatch, tmp_path):
    """AttentionClient.connect hands its connector failure.exit_now as on_failure before
    the connection (and its heartbeat) starts: a give-up between steps ends the worker
    process (status 1), whose engine then dies, as in a step."""
    seen = {}

    class Conn:
        ffn_rank = 0

        def connect(self):
            seen["on_failure"] = getattr(self, "on_failure", None)
            raise AFDPeerError("the test stops here")

        def is_up(self):
            return False

        def lost_at(self):
            return None

    import vllm.afd.attention as attention_role

    monkeypatch.setattr(attention_role, "create_attention_connector", lambda ctx: Conn())
    monkeypatch.setenv("VLLM_AFD_METRICS_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    stats = metrics.AFDStats()
    monkeypatch.setattr(metrics, "STATS", stats)
    vllm_config = types.SimpleNamespace(
        afd_config=AFDConfig.from_dict({"role": "attention"}),
        parallel_config=types.SimpleNamespace(data_parallel_rank=0),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=MAX_TOKENS),
        device_config=types.SimpleNamespace(device=torch.device("cpu")),
    )
    try:
        with pytest.raises(AFDPeerError, match="the test stops here"):
            AttentionClient().connect(vllm_config, fingerprint(), None)
    finally:
        stats.close()
    assert seen["on_failure"] is failure.exit_now


def test_an_idle_rejoin_refused_by_another_deployment_ends_the_engine(
    ffns, connected, tmp_path, monkeypatch
):
    """What comes back while idle is of another deployment (another checkpoint): refused at
    the re-handshake and the engine is ended at once with that error, as in a step; not
    retried every heartbeat until the window passes."""
    monkeypatch.setenv("VLLM_AFD_METRICS_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    port, first, att = connected(1, 30.0)
    ended: list[str] = []
    done = threading.Event()
    att.on_failure = lambda msg: (ended.append(msg), done.set())
    first.close()
    _lose(att)
    ffns(port, layers=1, checkpoint="ffffffffffffffffffffffff (other)")
    assert done.wait(8.0), "a refused rejoin did not end the engine"
    assert "fingerprint mismatch on 'checkpoint'" in ended[0]
    assert ended[0].startswith(f"lost AFD peer FFN rank 0 at {HOST}:{port}")


# ------------------------------------------------------------ the step re-run (client)
def client_for(att: tcp.TCPAttentionConnector, layers: int) -> AttentionClient:
    c = AttentionClient()
    for i in range(layers):
        c.register(i)
    c.connector = att
    return c


def test_interrupted_step_is_rerun_from_its_first_layer(ffns, connected):
    """Layer 0 of a step exchanged, then the FFN rank dies; a new one starts on its port
    0.3 s later. Layer 1's exchange holds, rejoins, re-runs the step (layer 0 as zero rows,
    layer 1 with its input) and returns layer 1's true output; layer 2 follows normally."""
    port, first, att = connected(3, 10)
    client = client_for(att, 3)
    xs = [torch.randn(4, HIDDEN) for _ in range(3)]
    assert torch.equal(client.exchange(xs[0], 0), 2 * xs[0])
    first.close()
    later = Bg(lambda: (time.sleep(0.3), ffns(port, layers=3))[1])
    out1 = client.exchange(xs[1], 1)
    assert torch.equal(out1, 2 * xs[1])
    assert torch.equal(client.exchange(xs[2], 2), 2 * xs[2])
    second = later.get()
    wait_until(lambda: second.steps, 5.0, "the re-run step served")
    (step_id, seen), *_ = second.steps
    assert step_id > 1
    assert torch.equal(seen[0], torch.zeros(4, HIDDEN))
    assert torch.equal(seen[1], xs[1]) and torch.equal(seen[2], xs[2])
    # the next step runs as usual
    x = torch.randn(3, HIDDEN)
    assert all(torch.equal(client.exchange(x, i), 2 * x) for i in range(3))


def test_rerun_of_a_gated_step_sends_zero_router_logits(ffns, attention):
    """Gate on the attention role: the re-run's earlier layers carry zero router logits of
    the connector's width, the interrupted layer its own."""
    port = free_port()
    width = 5
    first = ffns(port, layers=2, gated_width=width)
    att = attention(port, rejoin_timeout_s=10, num_router_logits=width)
    Bg(att.connect).get()
    client = AttentionClient()
    client.register(0, gated=True)
    client.register(1, gated=True)
    client.connector = att
    x0, x1 = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    l0, l1 = torch.randn(3, width), torch.randn(3, width)
    assert torch.equal(client.exchange(x0, 0, l0), 2 * x0)
    first.close()
    second = ffns(port, layers=2, gated_width=width)
    assert torch.equal(client.exchange(x1, 1, l1), 2 * x1)
    wait_until(lambda: second.steps, 5.0, "the re-run step served")
    assert torch.equal(second.steps[0][1][0], torch.zeros(3, HIDDEN))
    assert torch.equal(second.logits[0], torch.zeros(3, width))
    assert torch.equal(second.logits[1], l1)


def test_rejoin_retries_while_the_ffn_still_holds_the_old_connection(connected):
    """The attention side gave up on a live FFN rank (a timeout): until the FFN rank notices
    that connection's end it answers a new hello with 'attention rank 0 is already
    connected'; a rejoin retries that (at start-up it is a refusal)."""
    port, ffn, att = connected(1, 0)
    ffn.running.clear()  # the FFN rank reads nothing meanwhile
    time.sleep(0.1)  # its loop has paused (it polls every 0.05 s)
    att._fail(AFDPeerError("AFD peer FFN rank 0 did not answer within the timeout"), "recv")
    assert 0 in ffn.conn.peers
    job = Bg(att.reconnect, time.monotonic() + 10)
    time.sleep(1.0)
    assert job.is_alive() and not att.is_up()  # refused (busy) and retrying
    ffn.running.set()  # it sees EOF on the old connection, drops it, takes the new one
    job.get(10)
    assert att.is_up()
    wait_until(lambda: 0 in ffn.conn.peers, 5.0, "the rank taken again")


def test_failover_to_another_ffn_replica_and_back(ffns, attention):
    """2A2F replicas, connector_extra_config.ffn_failover: attention rank 0 loses FFN rank 0
    mid-step and is served at once by FFN rank 1, which takes it as a guest; once FFN rank 0
    is back, rank 0 moves home between steps and FFN rank 1 lets the guest go."""
    port = su.free_ports(2, consecutive=True)[0]
    topo = dict(m=2, n=2, timeout=30.0, extra={"ffn_failover": True})
    first = ffns(port, layers=2, rank=0, **topo)
    other = ffns(port, layers=2, rank=1, **topo)  # listens on port + 1
    att = attention(port, rejoin_timeout_s=20, **topo)
    assert att._replicas() == [0, 1]
    Bg(att.connect).get()
    client = client_for(att, 2)
    x0, x1 = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    assert torch.equal(client.exchange(x0, 0), 2 * x0)
    first.close()
    t0 = time.monotonic()
    assert torch.equal(client.exchange(x1, 1), 2 * x1)  # the re-run, on FFN rank 1
    assert time.monotonic() - t0 < 3.0
    assert att.ffn_rank == 1 and client.peers() == {"ffn_rank_1": True}
    wait_until(lambda: other.steps, 5.0, "the re-run served by the replica")
    assert other.conn.guest_ranks() == [0]
    home = ffns(port, layers=2, rank=0, **topo)
    wait_until(lambda: att.ffn_rank == 0, 8.0, "the move back home")
    x = torch.randn(3, HIDDEN)
    assert all(torch.equal(client.exchange(x, i), 2 * x) for i in range(2))
    wait_until(lambda: home.steps, 5.0, "the next step served at home")
    wait_until(lambda: 0 not in other.conn.peers, 5.0, "the replica let the guest go")
    assert other.conn.guest_ranks() == []


def test_a_failed_over_rank_names_its_replica_while_it_tries_home(ffns, attention):
    """Served by FFN rank 1 (failover) while its home stays down, the rank tries home every
    second (0.5 s each): meanwhile it names FFN rank 1 throughout (vllm:afd_peer_up's
    label, ffn_rank), and every step goes to FFN rank 1."""
    port = su.free_ports(2, consecutive=True)[0]
    topo = dict(m=2, n=2, timeout=30.0, extra={"ffn_failover": True})
    first = ffns(port, layers=1, rank=0, **topo)
    other = ffns(port, layers=1, rank=1, **topo)
    att = attention(port, rejoin_timeout_s=20, **topo)
    Bg(att.connect).get()
    client = client_for(att, 1)
    x = torch.randn(2, HIDDEN)
    first.close()
    assert torch.equal(client.exchange(x, 0), 2 * x)  # failed over
    seen = set()
    deadline = time.monotonic() + 2.5  # two or three tries of the home rank
    while time.monotonic() < deadline:
        seen.add((att.ffn_rank, tuple(client.peers())))
        time.sleep(0.01)
    assert seen == {(1, ("ffn_rank_1",))}
    assert torch.equal(client.exchange(x, 0), 2 * x)
    wait_until(lambda: len(other.steps) == 2, 5.0, "both steps served by FFN rank 1")


def test_a_home_ffn_rank_of_another_checkpoint_is_reported_and_backed_off(
    ffns, attention, monkeypatch
):
    """Failed over to FFN rank 1, the rank's home FFN rank comes back serving another
    checkpoint: each try home is refused. It is counted (vllm:afd_home_refusals_total),
    logged once at WARNING with the reason, and tried after a doubling wait. Before: the
    refusal was swallowed - no line on this side, no metric, a try every second (and an
    ERROR every second on the home FFN rank) while the guest replica carried double load."""
    lines: list[tuple[str, str]] = []

    def recorder(level):
        return lambda msg, *a, **k: lines.append((level, msg % a if a else msg))

    for level in ("warning", "error"):
        monkeypatch.setattr(tcp.logger, level, recorder(level))
    port = su.free_ports(2, consecutive=True)[0]
    topo = dict(m=2, n=2, timeout=30.0, extra={"ffn_failover": True})
    first = ffns(port, layers=1, rank=0, **topo)
    ffns(port, layers=1, rank=1, **topo)
    att = attention(port, rejoin_timeout_s=20, **topo)
    Bg(att.connect).get()
    client = client_for(att, 1)
    x = torch.randn(2, HIDDEN)
    first.close()
    assert torch.equal(client.exchange(x, 0), 2 * x)  # failed over to FFN rank 1
    assert att.ffn_rank == 1
    before = metrics.STATS.counters.get("home_refusals", 0)
    ffns(port, layers=1, rank=0, checkpoint="ffffffffffffffffffffffff (other)", **topo)
    time.sleep(6.5)
    refusals = metrics.STATS.counters.get("home_refusals", 0) - before
    refused_at_home = [m for lvl, m in lines if lvl == "error" and "refused attention hello" in m]
    told = [m for lvl, m in lines if lvl == "warning" and "stays on FFN rank 1" in m]
    print(f"6.5 s: {len(refused_at_home)} tries refused by the home FFN rank, {refusals} "
          f"counted; warnings: {told}")
    assert len(told) == 1, told
    assert "its own FFN rank 0 at" in told[0] and "fingerprint mismatch on 'checkpoint'" in told[0]
    # tries after 1 s, then waits of 2 s and 4 s: 2 or 3 in 6.5 s (one a second before)
    assert 1 <= refusals <= 3, refusals
    assert len(refused_at_home) == refusals
    assert att.ffn_rank == 1 and torch.equal(client.exchange(x, 0), 2 * x)  # still served
    fams = {f.name: f for f in metrics.collect_families([metrics.STATS.snapshot()
                                                         | {"role": "attention"}])}
    assert fams["vllm:afd_home_refusals"].samples[0].value >= refusals


def test_without_failover_a_rank_waits_for_its_own_ffn_rank(attention):
    att = attention(free_port(), rejoin_timeout_s=5, m=2, n=2)
    assert att._replicas() == [0]


def test_without_rejoin_a_lost_ffn_ends_the_step(ffns, connected):
    """rejoin_timeout_s 0: today's fail-fast path (the engine ends on this error)."""
    port, first, att = connected(2, 0)
    client = client_for(att, 2)
    x = torch.randn(2, HIDDEN)
    client.exchange(x, 0)
    first.close()
    ffns(port, layers=2)  # back at once, but not rejoined
    t0 = time.monotonic()
    with pytest.raises(AFDPeerError, match=rf"lost AFD peer FFN rank 0 at {HOST}:{port}"):
        client.exchange(x, 1)
    assert time.monotonic() - t0 < 1.0


def test_a_step_fails_as_today_once_rejoin_timeout_s_has_passed(connected):
    port, first, att = connected(2, 1.0)
    client = client_for(att, 2)
    x = torch.randn(2, HIDDEN)
    client.exchange(x, 0)
    first.close()
    t0 = time.monotonic()
    with pytest.raises(AFDPeerError) as err:
        client.exchange(x, 1)
    took = time.monotonic() - t0
    assert 0.8 < took < 3.0, took
    msg = str(err.value)
    assert f"lost AFD peer FFN rank 0 at {HOST}:{port}" in msg
    assert "did not come back within rejoin_timeout_s=1" in msg


def test_outage_seconds_and_peer_up_while_waiting(ffns, connected):
    port, first, att = connected(1, 0)
    client = client_for(att, 1)
    assert client.outage_seconds() == 0.0
    assert client.peers() == {"ffn_rank_0": True}
    first.close()
    _lose(att)
    time.sleep(0.2)
    assert client.outage_seconds() >= 0.2
    assert client.peers() == {"ffn_rank_0": False}
    ffns(port, layers=1)
    att.reconnect(time.monotonic() + 10)
    assert client.outage_seconds() == 0.0 and client.peers() == {"ffn_rank_0": True}


def test_outage_gauge_and_rejoin_counters_in_prometheus():
    snap = {
        "role": "attention",
        "rank": 0,
        "counters": {"rejoins": 2, "outage_seconds": 3.5, "steps": 9},
        "peers": {"ffn_rank_0": False},
        "outage_seconds": 1.25,
        "histograms": {},
        "layers": {},
    }
    fams = {f.name: f for f in metrics.collect_families([snap])}
    assert fams["vllm:afd_rejoins"].samples[0].value == 2
    assert fams["vllm:afd_outage_seconds"].samples[0].value == 3.5
    assert fams["vllm:afd_peer_outage_seconds"].samples[0].value == 1.25
    assert fams["vllm:afd_peer_up"].samples[0].value == 0.0


def test_health_says_an_attention_rank_waits_for_its_ffn_rank():
    up = {"role": "attention", "rank": 0, "peers": {"ffn_rank_0": True}, "outage_seconds": 0.0}
    ffn = {"role": "ffn", "rank": 0, "peers": {}, "outage_seconds": None}
    assert metrics.health_problem([up, ffn]) is None
    assert metrics.health_problem([]) is None
    down = dict(up, peers={"ffn_rank_0": False}, outage_seconds=12.34)
    msg = metrics.health_problem([down, ffn])
    assert msg.startswith("AFD: waiting for a lost FFN rank to come back: attention rank 0 ")
    assert "(12.3 s)" in msg


def test_rejoin_is_not_tried_for_micro_batched_steps_or_connectors_that_cannot():
    cfg = types.SimpleNamespace(config=AFDConfig.from_dict({"role": "attention"}))
    can = types.SimpleNamespace(can_rejoin=True, ctx=cfg)
    cannot = types.SimpleNamespace(can_rejoin=False, ctx=cfg)
    assert rejoin.possible(can, ubatched=False)
    assert not rejoin.possible(can, ubatched=True)
    assert not rejoin.possible(cannot, ubatched=False)
    off = types.SimpleNamespace(
        can_rejoin=True,
        ctx=types.SimpleNamespace(
            config=AFDConfig.from_dict({"role": "attention", "rejoin_timeout_s": 0})
        ),
    )
    assert not rejoin.possible(off, ubatched=False)
