"""TCP AFD connector (vllm.distributed.afd.tcp) over real sockets on 127.0.0.1.

Run with the project venv (torch + vLLM with the overlay):
    .venv/bin/python -m pytest tests/unit/connectors/test_tcp_connector.py
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import tcp_lib
import torch
from tcp_lib import (
    HIDDEN,
    HOST,
    MAX_TOKENS,
    TIMEOUT,
    Bg,
    assert_dropped,
    connected_pair,
    fingerprint,
    kill,
    make_ctx,
    serve_one_step,
    step_to_ffn,
    wait_lost,
    wait_peers,
    wait_until,
)

from serve_util import free_port
from vllm.afd import protocol as P
from vllm.distributed.afd import tcp
from vllm.distributed.afd.base import (
    create_attention_connector,
    create_ffn_connector,
)

net = tcp_lib.net  # the fixture


# ------------------------------------------------------------------ registry
def test_registry_builds_tcp_connectors():
    port = free_port()
    assert isinstance(create_ffn_connector(make_ctx("ffn", port)), tcp.TCPFFNConnector)
    att = create_attention_connector(make_ctx("attention", port))
    assert isinstance(att, tcp.TCPAttentionConnector)
    assert att.addr == (HOST, port)


def test_rank_layout_ports():
    port = free_port()
    att = tcp.TCPAttentionConnector(make_ctx("attention", port, rank=3, m=4, n=2))
    assert att.ffn_rank == 1
    assert att.addr == (HOST, port + 1)
    ffn = tcp.TCPFFNConnector(make_ctx("ffn", port, rank=1, m=4, n=2))
    assert ffn.expected == {2, 3}
    assert ffn.addr == (HOST, port + 1)


def test_ffn_ranks_at_their_own_addresses_are_dialled_by_name(net):
    """ffn_addresses: FFN rank 0 listens on 127.0.0.2, FFN rank 1 on 127.0.0.1 (two hosts'
    worth of loopback addresses), and attention rank 1 reaches its FFN rank by DNS name."""
    p0, p1 = free_port(), free_port()
    addresses = [f"127.0.0.2:{p0}", f"localhost:{p1}"]
    kw = dict(m=2, n=2, addresses=addresses)
    ffn0 = net.ffn(p0, rank=0, host="127.0.0.2", **kw)
    ffn1 = net.ffn(p1, rank=1, host="127.0.0.1", **kw)
    assert ffn0.addr == ("127.0.0.2", p0) and ffn1.addr == ("127.0.0.1", p1)
    ffn0.start()
    ffn1.start()
    att0 = net.attention(p0, rank=0, **kw)
    att1 = net.attention(p0, rank=1, **kw)
    assert att1.peer == f"FFN rank 1 at localhost:{p1}"
    Bg(att0.connect).get()
    Bg(att1.connect).get()
    for att, ffn, rank in ((att0, ffn0, 0), (att1, ffn1, 1)):
        wait_until(lambda f=ffn, r=rank: r in f.peers)
        att.begin_step(1, 3)
        (peer,) = wait_peers(ffn, [rank]).values()
        x = torch.randn(3, HIDDEN)
        att.send(x)
        buf = torch.empty(3, HIDDEN)
        ffn.recv(peer, buf)
        ffn.send(peer, buf + rank)
        out = torch.empty(3, HIDDEN)
        assert torch.equal(att.recv(out), x + rank)
        att.end_step()


def test_an_unreachable_ffn_address_is_named(net):
    port = free_port()
    att = net.attention(port, addresses=[f"no-such-host.invalid:{port}"], timeout=0.5)
    with pytest.raises(P.AFDPeerError, match=rf"FFN rank 0 at no-such-host\.invalid:{port} "
                                             r"within timeout_s=0\.5.*ffn_addresses"):
        att.connect()


# ------------------------------------------------------------------- (a) 1A1F
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_1a1f_handshake_step_goodbye(net, dtype):
    ffn, att = connected_pair(net)
    for step in (1, 2):
        t = 5 + step
        att.begin_step(step, t)
        (peer,) = wait_peers(ffn, [0]).values()
        assert peer.control.type == P.MSG_STEP
        assert (peer.control.step_id, peer.control.num_tokens) == (step, t)
        for layer in range(2):
            x = torch.randn(t, HIDDEN).to(dtype) + layer
            att.send(x)
            buf = torch.empty(t, HIDDEN, dtype=dtype)
            ffn.recv(peer, buf)
            assert torch.equal(buf, x)
            y = buf * 2 + 1
            ffn.send(peer, y)
            out = torch.empty(t, HIDDEN, dtype=dtype)
            assert att.recv(out) is out
            assert torch.equal(out, y)
        att.end_step()
    att.close()
    assert att.sock is None
    deadline = time.monotonic() + 5
    while 0 in ffn.peers:
        assert time.monotonic() < deadline, "FFN did not see the goodbye"
        assert ffn.wait_step(0.1) == []
    # a clean goodbye is not an error: the FFN keeps serving (nothing to do)
    assert ffn.wait_step(0.05) == []


def test_1a1f_large_tensor_both_directions_concurrently(net):
    """1 MiB per direction: more than a socket buffer, so sends and receives interleave."""
    ffn, att = connected_pair(net, timeout=5.0)
    t = MAX_TOKENS
    width = 4096
    x = torch.randn(t, width)
    y = torch.randn(t, width)

    def attention_side():
        att.begin_step(9, t)
        att.send(x)
        out = torch.empty(t, width)
        att.recv(out)
        att.end_step()
        return out

    bg = Bg(attention_side)
    (peer,) = wait_peers(ffn, [0]).values()
    buf = torch.empty(t, width)
    ffn.recv(peer, buf)
    ffn.send(peer, y)
    assert torch.equal(buf, x)
    assert torch.equal(bg.get(), y)


def test_ffn_send_non_contiguous(net):
    ffn, att = connected_pair(net)
    att.begin_step(1, 4)
    (peer,) = wait_peers(ffn, [0]).values()
    y = torch.arange(4 * HIDDEN, dtype=torch.float32).reshape(HIDDEN, 4).t()
    assert not y.is_contiguous()
    ffn.send(peer, y)
    out = torch.empty(4, HIDDEN)
    att.recv(out)
    assert torch.equal(out, y)
    att.end_step()


def test_attention_connect_retries_until_ffn_starts(net):
    port = free_port()
    att = net.attention(port, timeout=5.0)
    bg = Bg(att.connect)
    time.sleep(0.6)
    ffn = net.ffn(port, timeout=5.0)
    ffn.start()
    bg.get()
    wait_until(lambda: 0 in ffn.peers)


def _self_connect(port: int) -> socket.socket:
    """A socket TCP-connected to itself on HOST:port, as the kernel may make when a
    client's ephemeral source port happens to equal the port it dials."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((HOST, port))
    s.connect((HOST, port))
    return s


def test_self_connected_detection():
    port = free_port()
    s = _self_connect(port)
    try:
        assert tcp._self_connected(s)
    finally:
        s.close()
    with socket.socket() as lst:
        lst.bind((HOST, 0))
        lst.listen(1)
        with socket.create_connection(lst.getsockname(), timeout=2) as c:
            assert not tcp._self_connected(c)


def test_attention_self_connect_is_dropped_and_retried(net, monkeypatch):
    """CI hit this: attention started first, one retry connected to itself, kept the
    FFN's port (FFN: "Address already in use") and waited on its own hello."""
    port = free_port()
    real = socket.create_connection
    calls = []

    def create_connection(addr, *a, **kw):
        calls.append(addr)
        if len(calls) == 1:
            return _self_connect(addr[1])
        return real(addr, *a, **kw)

    monkeypatch.setattr(tcp.socket, "create_connection", create_connection)
    att = net.attention(port, timeout=5.0)
    bg = Bg(att.connect)
    wait_until(lambda: len(calls) >= 1, what="first connect attempt")
    time.sleep(0.3)
    ffn = net.ffn(port, timeout=5.0)
    ffn.start()  # the port is free again: the self-connected socket was closed
    bg.get()
    wait_until(lambda: 0 in ffn.peers)
    assert len(calls) >= 2


def test_attention_to_a_foreign_listener_names_the_handshake(net):
    """CI hit this: something else (another program's bind(0) port) listened on the FFN
    port, took the hello and closed; the error says so instead of a bare EOF."""
    with socket.socket() as lst:
        lst.bind((HOST, free_port()))
        lst.listen(1)

        def take_and_close():
            c, _ = lst.accept()
            c.recv(64)
            c.close()

        t = threading.Thread(target=take_and_close, daemon=True)
        t.start()
        att = net.attention(lst.getsockname()[1], timeout=3.0)
        t0 = time.monotonic()
        # EOF, or a reset where the hello was not read to its end
        during = r"(connection closed|reset by peer) \(during the AFD handshake, before any reply"
        with pytest.raises(P.AFDPeerError, match=during):
            att.connect()
        assert time.monotonic() - t0 < 3.0
        t.join(2)


@pytest.mark.skipif(tcp.ephemeral_port_range() is None, reason="no ephemeral port range")
def test_ffn_port_in_ephemeral_range_is_warned(net, monkeypatch):
    warnings = []
    monkeypatch.setattr(tcp.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    lo, hi = tcp.ephemeral_port_range()
    with socket.socket() as s:  # bind(0) picks from the ephemeral range
        s.bind((HOST, 0))
        eph_port = s.getsockname()[1]
    assert lo <= eph_port <= hi
    net.ffn(eph_port).start()
    assert any(f"port {eph_port}, inside this host's ephemeral port range" in w for w in warnings)
    warnings.clear()
    net.ffn(free_port()).start()  # below the range: no warning
    assert not [w for w in warnings if "ephemeral" in w], warnings


def test_micro_batched_step_controls(net):
    """DBO: micro-batch 1's control follows micro-batch 0's first layer on the wire;
    the FFN reads it with recv_control."""
    ffn, att = connected_pair(net)
    att.begin_step(3, 5, ubatch=(0, 2))
    (peer,) = wait_peers(ffn, [0]).values()
    assert (peer.control.step_id, P.ubatch_of(peer.control.flags)) == (3, (0, 2))
    x0, x1 = torch.randn(5, HIDDEN), torch.randn(2, HIDDEN)
    att.send(x0)
    att.begin_step(3, 2, ubatch=(1, 2))
    att.send(x1)
    buf = torch.empty(5, HIDDEN)
    ffn.recv(peer, buf)
    assert torch.equal(buf, x0)
    ctrl = ffn.recv_control(peer)
    assert (ctrl.step_id, ctrl.num_tokens, P.ubatch_of(ctrl.flags)) == (3, 2, (1, 2))
    buf1 = torch.empty(2, HIDDEN)
    ffn.recv(peer, buf1)
    assert torch.equal(buf1, x1)
    att.end_step()


def test_micro_batches_larger_than_socket_buffers_do_not_deadlock(net):
    """The DBO order with 16 MiB messages: micro-batch 1 sends while the FFN rank
    sends micro-batch 0's reply. recv_start drains that reply in the background;
    a plain recv after both sends would leave both sides blocked in sendall."""
    ffn, att = connected_pair(net, timeout=10.0)
    big = (4 * 1024 * 1024 // HIDDEN, HIDDEN)  # 16 MiB of float32
    x0, x1 = torch.randn(big), torch.randn(big)

    def serve():
        (peer,) = wait_peers(ffn, [0]).values()
        buf = torch.empty(big)
        ffn.recv(peer, buf)
        ffn.send(peer, buf * 2)
        ctrl = ffn.recv_control(peer)
        ffn.recv(peer, buf)
        ffn.send(peer, buf * 3)
        return ctrl

    srv = Bg(serve)
    att.begin_step(1, 64, ubatch=(0, 2))
    att.send(x0)
    w0 = att.recv_start(torch.empty(big))
    att.begin_step(1, 64, ubatch=(1, 2))
    att.send(x1)
    w1 = att.recv_start(torch.empty(big))
    assert torch.equal(w0(), x0 * 2) and torch.equal(w1(), x1 * 3)
    assert P.ubatch_of(srv.get(20).flags) == (1, 2)
    att.end_step()


def test_background_receive_from_a_dead_ffn_fails_fast(net):
    ffn, att = connected_pair(net, timeout=10.0)
    att.begin_step(1, 4, ubatch=(0, 2))
    wait = att.recv_start(torch.empty(4, HIDDEN))
    ffn.close()
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError, match="lost AFD peer"):
        wait()
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(P.AFDPeerError):
        att.send(torch.zeros(1, HIDDEN))  # the connection is marked dead


def test_recv_control_of_a_silent_peer_times_out(net):
    ffn, att = connected_pair(net, timeout=1.0)
    att.begin_step(1, 1, ubatch=(0, 2))
    (peer,) = wait_peers(ffn, [0]).values()
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError):
        ffn.recv_control(peer)
    assert time.monotonic() - t0 < 3.0


def test_heartbeats_keep_idle_peer_alive(net):
    """Idle for longer than timeout_s: heartbeats keep the FFN from dropping the peer."""
    ffn, att = connected_pair(net, timeout=1.0)
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:
        assert ffn.wait_step(0.1) == []
    assert 0 in ffn.peers
    att.begin_step(3, 2)
    (peer,) = wait_peers(ffn, [0]).values()
    assert peer.control.step_id == 3
    att.end_step()


def test_step_with_too_many_tokens_is_a_protocol_error(net):
    ffn, att = connected_pair(net)
    att.begin_step(1, MAX_TOKENS + 1)
    assert "broke the protocol: step with 65 tokens" in wait_lost(ffn, 0)


# ------------------------------------------------------------------- (b) 2A1F
def test_2a1f_both_ranks_step(net):
    port = free_port()
    ffn = net.ffn(port, m=2)
    ffn.start()
    atts = [net.attention(port, rank=r, m=2) for r in (0, 1)]
    threads = [Bg(a.connect) for a in atts]
    for th in threads:
        th.get()
    wait_until(lambda: set(ffn.peers) == {0, 1})
    atts[0].begin_step(11, 3)
    atts[1].begin_step(11, 5)
    peers = wait_peers(ffn, [0, 1])
    assert peers[0].control.num_tokens == 3
    assert peers[1].control.num_tokens == 5
    for r, a in enumerate(atts):
        t = peers[r].control.num_tokens
        x = torch.full((t, HIDDEN), float(r + 1))
        a.send(x)
        buf = torch.empty(t, HIDDEN)
        ffn.recv(peers[r], buf)
        assert torch.equal(buf, x)
        ffn.send(peers[r], -buf)
        out = torch.empty(t, HIDDEN)
        assert torch.equal(a.recv(out), -x)
        a.end_step()


def test_2a1f_duplicate_rank_refused(net):
    port = free_port()
    ffn = net.ffn(port, m=2)
    ffn.start()
    first = net.attention(port, rank=0, m=2)
    Bg(first.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    dup = net.attention(port, rank=0, m=2)
    with pytest.raises(P.AFDHandshakeError, match=r"attention rank 0 is already connected"):
        Bg(dup.connect).get()
    assert ffn.wait_step(0.1) == []  # not fatal
    assert 0 in ffn.peers


def test_2a1f_missing_rank_times_out(net):
    port = free_port()
    ffn = net.ffn(port, m=2)
    ffn.start()
    att = net.attention(port, rank=0, m=2)
    Bg(att.connect).get()
    with pytest.raises(P.AFDPeerError, match=r"attention rank\(s\) \[1\] did not connect"):
        deadline = time.monotonic() + TIMEOUT + 3
        while time.monotonic() < deadline:
            ffn.wait_step(0.1)


def test_2a1f_elastic_ffn_serves_with_an_empty_slot(net):
    """ffn_elastic_attention: an attention slot that never connects does not end the FFN
    rank; the connected rank is served, and the empty slot's rank is taken when it comes."""
    port = free_port()
    ffn = net.ffn(port, m=2, extra={"ffn_elastic_attention": True})
    ffn.start()
    att = net.attention(port, rank=0, m=2)
    Bg(att.connect).get()
    deadline = time.monotonic() + TIMEOUT + 1.5
    while time.monotonic() < deadline:  # past timeout_s with rank 1 absent: no error
        ffn.wait_step(0.1)
    serve_one_step(ffn, att, 1)
    late = net.attention(port, rank=1, m=2)
    Bg(late.connect).get()
    wait_until(lambda: 1 in ffn.peers)
    serve_one_step(ffn, late, 1)


# ------------------------------------------------------- (c) fingerprint mismatch
def test_fingerprint_mismatch_fails_attention_and_ffn_at_its_timeout(net):
    """The attention rank fails at once; the FFN rank refuses the hello but does not end
    on it (a hello proves nothing): it ends at its start-up timeout, naming the refusal."""
    port = free_port()
    ffn = net.ffn(port, num_hidden_layers=2, timeout=1.5)
    ffn.start()
    att = net.attention(port, num_hidden_layers=3, timeout=1.5)
    with pytest.raises(P.AFDHandshakeError, match=r"'num_hidden_layers'") as ei:
        Bg(att.connect).get()
    msg = str(ei.value)
    assert "refused this attention rank" in msg
    assert f"{HOST}:{port}" in msg
    assert att.sock is None
    assert ffn.wait_step(0.1) == []  # still waiting for the right peer
    with pytest.raises(
        P.AFDPeerError,
        match=r"did not connect within timeout_s=1\.5\. Last "
        r"refused hello: AFD fingerprint mismatch on 'num_hidden_layers'",
    ):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ffn.wait_step(0.1)


def test_mismatched_hello_does_not_end_a_running_ffn(net):
    """A well-formed attention hello of another deployment, sent to a running FFN rank, is
    refused; the connected peer keeps being served."""
    ffn, att = connected_pair(net)
    bad = net.attention(ffn.addr[1], num_hidden_layers=3)
    with pytest.raises(P.AFDHandshakeError, match=r"'num_hidden_layers'"):
        Bg(bad.connect).get()
    peer, x, buf = step_to_ffn(ffn, att, 1, 2)
    ffn.send(peer, buf + 1)
    assert torch.equal(att.recv(torch.empty(2, HIDDEN)), x + 1)
    att.end_step()


def test_fingerprint_mismatch_role_topology(net):
    """Attention built for 2A1F against an FFN built for 1A1F."""
    port = free_port()
    ffn = net.ffn(port)
    ffn.start()
    att = net.attention(port, m=2)
    with pytest.raises(P.AFDHandshakeError, match=r"'num_attention_ranks'"):
        Bg(att.connect).get()


# ---------------------------------------------------------- (d) garbage clients
def test_garbage_clients_do_not_disturb_a_peer(net):
    port = free_port()
    ffn = net.ffn(port)
    ffn.start()
    half_open = net.raw(port)  # connects, never sends anything
    # random bytes (not starting with the hello magic), then close
    junk = net.raw(port)
    junk.sendall(b"JUNK" + os.urandom(200))
    junk.close()
    # an attention rank still connects at once (handshakes run in their own threads)
    att = net.attention(port)
    t0 = time.monotonic()
    Bg(att.connect).get()
    assert time.monotonic() - t0 < 1.5
    wait_until(lambda: 0 in ffn.peers)

    # more strangers after the peer is connected
    http = net.raw(port)
    http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert_dropped(http)  # dropped without an answer
    big = net.raw(port)
    big.sendall(P.HELLO_PREAMBLE.pack(P.HELLO_MAGIC, P.MAX_HELLO_BYTES + 1))
    assert_dropped(big)
    notjson = net.raw(port)
    notjson.sendall(P.HELLO_PREAMBLE.pack(P.HELLO_MAGIC, 5) + b"\xff\xfe{]x")
    assert_dropped(notjson)
    short = net.raw(port)
    short.sendall(b"AFD")
    short.close()
    # a well-formed hello that is not an attention rank: answered, not fatal
    probe = net.raw(port)
    probe.sendall(P.pack_hello({"role": "probe"}))
    n = P.unpack_hello_preamble(probe.recv(P.HELLO_PREAMBLE.size, socket.MSG_WAITALL))
    reply = P.parse_hello(probe.recv(n, socket.MSG_WAITALL))
    assert reply["status"] != "ok"
    assert reply["role"] == "ffn"

    for step in (1, 2):
        assert ffn.wait_step(0.1) == []
        att.begin_step(step, 2)
        (peer,) = wait_peers(ffn, [0]).values()
        x = torch.randn(2, HIDDEN)
        att.send(x)
        buf = torch.empty(2, HIDDEN)
        ffn.recv(peer, buf)
        ffn.send(peer, buf + 1)
        out = torch.empty(2, HIDDEN)
        assert torch.equal(att.recv(out), x + 1)
        att.end_step()
    assert set(ffn.peers) == {0}

    # the silent connection is dropped by the FFN after its handshake deadline
    assert_dropped(half_open, timeout=TIMEOUT + 3)


# ---------------------------------------------------------- (e) nobody listening
def test_connect_without_ffn_fails_within_timeout(net):
    port = free_port()
    att = net.attention(port)
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError) as ei:
        Bg(att.connect).get()
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT + 2
    assert elapsed >= TIMEOUT - 0.5  # it retried until the deadline
    msg = str(ei.value)
    assert f"{HOST}:{port}" in msg
    assert "timeout_s=2" in msg
    with pytest.raises(P.AFDPeerError, match="not connected"):
        att.begin_step(1, 1)


# ----------------------------------------------------------- (f) no attention
def test_ffn_without_attention_times_out(net):
    port = free_port()
    ffn = net.ffn(port)
    ffn.start()
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError) as ei:
        while time.monotonic() - t0 < TIMEOUT + 3:
            assert ffn.wait_step(0.1) == []
    elapsed = time.monotonic() - t0
    assert TIMEOUT - 0.2 <= elapsed < TIMEOUT + 2
    msg = str(ei.value)
    assert "attention rank(s) [0] did not connect within timeout_s=2" in msg
    assert f"{HOST}:{port}" in msg


# ------------------------------------------------------------ (g) port in use
def test_port_in_use(net):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((HOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        ffn = net.ffn(port)
        with pytest.raises(P.AFDPeerError, match=rf"cannot listen on {HOST}:{port}"):
            ffn.start()
        assert ffn.listener is None


def test_second_ffn_on_same_port(net):
    port = free_port()
    net.ffn(port).start()
    with pytest.raises(P.AFDPeerError, match=rf"AFD FFN rank 0 cannot listen on {HOST}:{port}"):
        net.ffn(port).start()


# ------------------------------------------------- (h) attention dies mid-step
@pytest.mark.parametrize("rst", [True, False], ids=["reset", "fin"])
def test_attention_killed_mid_step(net, rst):
    ffn, att = connected_pair(net, timeout=5.0)
    att.begin_step(1, 4)
    (peer,) = wait_peers(ffn, [0]).values()
    att.send(torch.zeros(2, HIDDEN))  # half of the layer input, then death
    threading.Timer(0.3, kill, (att.sock, rst)).start()
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError, match=r"lost AFD peer attention rank 0 at 127\.0\.0\.1:\d+"):
        ffn.recv(peer, torch.empty(4, HIDDEN))
    assert time.monotonic() - t0 < 2.0


def test_attention_killed_between_steps(net):
    ffn, att = connected_pair(net, timeout=5.0)
    assert ffn.wait_step(0.05) == []
    kill(att.sock, rst=True)
    t0 = time.monotonic()
    assert "lost AFD peer attention rank 0 at " in wait_lost(ffn, 0, timeout=4.0)
    assert time.monotonic() - t0 < 2.0


def test_attention_silent_mid_step_times_out(net):
    """A live but silent peer: FFN recv gives up after timeout_s, not never."""
    ffn, att = connected_pair(net, timeout=1.0)
    att.begin_step(1, 4)
    (peer,) = wait_peers(ffn, [0]).values()
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError, match=r"did not answer within the timeout"):
        ffn.recv(peer, torch.empty(4, HIDDEN))
    assert 0.8 <= time.monotonic() - t0 < 3.0


# ------------------------------------------------- (i) FFN dies while attention waits
def test_ffn_closed_while_attention_in_recv(net):
    ffn, att = connected_pair(net, timeout=5.0)
    att.begin_step(1, 4)
    (peer,) = wait_peers(ffn, [0]).values()
    x = torch.randn(4, HIDDEN)
    att.send(x)
    buf = torch.empty(4, HIDDEN)
    ffn.recv(peer, buf)
    threading.Timer(0.3, ffn.close).start()
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError, match=rf"lost AFD peer FFN rank 0 at {HOST}:{att.addr[1]}"):
        att.recv(torch.empty(4, HIDDEN))
    assert time.monotonic() - t0 < 2.0
    # the connector stays dead
    with pytest.raises(P.AFDPeerError, match="lost AFD peer FFN rank 0"):
        att.begin_step(2, 4)


def test_ffn_silent_while_attention_in_recv(net):
    ffn, att = connected_pair(net, timeout=1.0)
    att.begin_step(1, 4)
    wait_peers(ffn, [0])
    t0 = time.monotonic()
    with pytest.raises(P.AFDPeerError, match="did not answer within the timeout"):
        att.recv(torch.empty(4, HIDDEN))
    assert 0.8 <= time.monotonic() - t0 < 3.0


# ---------------------------------------------------------------- (j) secret
def test_shared_secret_mismatch_refused(net, monkeypatch):
    port = free_port()
    monkeypatch.setenv("VLLM_AFD_SECRET", "right-secret")
    monkeypatch.setenv("AFD_TEST_OTHER_SECRET", "wrong-secret")
    ffn = net.ffn(port, timeout=5.0)  # reads VLLM_AFD_SECRET
    ffn.start()
    att = net.attention(port, timeout=5.0, extra={"secret_env": "AFD_TEST_OTHER_SECRET"})
    with pytest.raises(
        P.AFDHandshakeError, match=r"authentication failed \(shared secret differs\)"
    ):
        Bg(att.connect).get()
    # no secret at all (the named variable is unset) is refused as well, naming it
    monkeypatch.delenv("AFD_TEST_UNSET_SECRET", raising=False)
    nosecret = net.attention(port, timeout=5.0, extra={"secret_env": "AFD_TEST_UNSET_SECRET"})
    with pytest.raises(
        P.AFDHandshakeError,
        match="requires authentication but this attention "
        "rank has no shared secret: set AFD_TEST_UNSET_SECRET",
    ):
        Bg(nosecret.connect).get()
    # a refused stranger is not fatal: the FFN still takes the right attention rank
    assert ffn.wait_step(0.1) == []
    assert ffn.peers == {}
    good = net.attention(port, timeout=5.0)
    Bg(good.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    good.begin_step(1, 1)
    (peer,) = wait_peers(ffn, [0]).values()
    assert peer.control.num_tokens == 1
    good.end_step()


def test_shared_secret_same_value_other_variable_accepted(net, monkeypatch):
    port = free_port()
    monkeypatch.setenv("VLLM_AFD_SECRET", "same")
    monkeypatch.setenv("AFD_TEST_OTHER_SECRET", "same")
    ffn = net.ffn(port)
    ffn.start()
    att = net.attention(port, extra={"secret_env": "AFD_TEST_OTHER_SECRET"})
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)


# --------------------------------------------- hostile hellos (handshake robustness)
HOSTILE_HELLOS = [
    pytest.param("right", {}, id="secret-empty-hello"),
    pytest.param("right", {"role": "attention", "rank": 0}, id="secret-no-afd_revision"),
    pytest.param(None, {**fingerprint(), "role": "attention", "rank": [0]}, id="list-rank"),
]


def _hostile(net, monkeypatch, secret, hello, wait=True):
    """Start an FFN, send `hello` from a stranger; returns (ffn, port, reply-or-None, errors)."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_type))
    if secret:
        monkeypatch.setenv("VLLM_AFD_SECRET", secret)
    else:
        monkeypatch.delenv("VLLM_AFD_SECRET", raising=False)
    port = free_port()
    ffn = net.ffn(port, timeout=5.0)
    ffn.start()
    s = net.raw(port)
    s.sendall(P.pack_hello(hello))
    if not wait:
        time.sleep(0.2)  # let the handshake thread finish while excepthook is patched
        return ffn, port, None, errors
    s.settimeout(1.5)
    try:
        reply = s.recv(P.HELLO_PREAMBLE.size)  # a refusal, or b"" when dropped
    except ConnectionResetError:
        reply = b""
    except TimeoutError:
        reply = None  # neither answered nor closed
    return ffn, port, reply, errors


@pytest.mark.parametrize("secret, hello", HOSTILE_HELLOS)
def test_hostile_hello_does_not_disturb_the_deployment(net, monkeypatch, secret, hello):
    ffn, port, _, _ = _hostile(net, monkeypatch, secret, hello, wait=False)
    att = net.attention(port, timeout=5.0)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    att.begin_step(1, 1)
    (peer,) = wait_peers(ffn, [0]).values()
    assert peer.control.num_tokens == 1
    att.end_step()


@pytest.mark.parametrize("secret, hello", HOSTILE_HELLOS)
def test_hostile_hello_refused_cleanly(net, monkeypatch, secret, hello):
    _, _, reply, errors = _hostile(net, monkeypatch, secret, hello)
    time.sleep(0.1)
    assert errors == [], f"handshake thread died: {errors}"
    assert reply is not None, "stranger neither answered nor disconnected"


# ------------------------------------------------------ staging, empty tensors
def test_attention_recv_into_non_contiguous_out(net):
    ffn, att = connected_pair(net)
    att.begin_step(1, 3)
    (peer,) = wait_peers(ffn, [0]).values()
    y = torch.randn(3, HIDDEN)
    ffn.send(peer, y)
    big = torch.zeros(HIDDEN, 3)
    out = big.t()  # [3, HIDDEN], not contiguous
    assert not out.is_contiguous()
    assert att.recv(out) is out
    assert torch.equal(out, y)
    assert torch.equal(big, y.t())
    att.end_step()


def test_zero_size_transfers(net):
    ffn, att = connected_pair(net)
    att.begin_step(1, 2)
    (peer,) = wait_peers(ffn, [0]).values()
    att.send(torch.empty(2, 0))
    ffn.recv(peer, torch.empty(2, 0))
    ffn.send(peer, torch.empty(2, 0))
    assert att.recv(torch.empty(2, 0)).numel() == 0
    # the stream is still in sync afterwards
    x = torch.randn(2, HIDDEN)
    att.send(x)
    buf = torch.empty(2, HIDDEN)
    ffn.recv(peer, buf)
    assert torch.equal(buf, x)
    att.end_step()


# ------------------------------------------------------------ start / close race
def test_close_right_after_start():
    """Deterministic form of the race: the accept thread first runs after close()."""
    ffn = tcp.TCPFFNConnector(make_ctx("ffn", free_port()))
    ffn.start()
    lst = ffn.listener
    wait_until(lambda: lst.gettimeout() == 0.5, 2.0)  # the real thread got going
    ffn.close()
    ffn._accept_loop()  # what a late-starting accept thread runs: must just return


# ------------------------------------------------------------ batch window
def _two_ranks(net, window_ms):
    port = free_port()
    ffn = net.ffn(port, m=2, extra={"batch_window_ms": window_ms})
    ffn.start()
    atts = [net.attention(port, rank=r, m=2) for r in (0, 1)]
    for a in atts:
        Bg(a.connect).get()
    wait_until(lambda: set(ffn.peers) == {0, 1})
    return ffn, atts


def _serve_one(ffn, att, rank):
    att.begin_step(1, 1)
    (peer,) = wait_peers(ffn, [rank]).values()
    x = torch.randn(1, HIDDEN)
    att.send(x)
    buf = torch.empty(1, HIDDEN)
    ffn.recv(peer, buf)
    ffn.send(peer, buf)
    att.recv(torch.empty(1, HIDDEN))
    att.end_step()


def test_batch_window_joins_a_rank_that_steps_a_moment_later(net):
    ffn, (a0, a1) = _two_ranks(net, window_ms=500)
    _serve_one(ffn, a1, 1)  # rank 1 is now a recently active rank
    a0.begin_step(2, 3)
    threading.Timer(0.05, a1.begin_step, args=(2, 4)).start()
    ready = ffn.wait_step(1.0)
    assert sorted((p.rank, p.control.num_tokens) for p in ready) == [(0, 3), (1, 4)]


def test_the_batch_window_reads_no_data_of_a_step_already_read(net):
    """Regression: while the window waited for a recently active rank, the sockets of all
    ranks were read between steps - the first layer's data of the step already read
    (sent right after its control message) included, taken for a control message."""
    ffn, (a0, a1) = _two_ranks(net, window_ms=300)
    _serve_one(ffn, a1, 1)  # rank 1 is now a recently active rank
    a0.begin_step(2, 3)
    x = torch.randn(3, HIDDEN)
    a0.send(x)
    ready = ffn.wait_step(1.0)
    assert [(p.rank, p.control.num_tokens) for p in ready] == [(0, 3)]
    buf = torch.empty(3, HIDDEN)
    ffn.recv(ready[0], buf)
    assert torch.equal(buf, x) and set(ffn.peers) == {0, 1}


def test_goodbye_of_a_recently_active_rank_during_the_batch_window(net):
    """Regression: the window waited on the socket of a rank that had just said goodbye."""
    ffn, (a0, a1) = _two_ranks(net, window_ms=200)
    _serve_one(ffn, a1, 1)
    a1.close()  # goodbye
    time.sleep(0.1)
    a0.begin_step(2, 2)
    time.sleep(0.1)  # both the goodbye and the step are waiting to be read
    ready = ffn.wait_step(1.0)
    while not ready:  # the goodbye may be read by one call, the step by the next
        ready = ffn.wait_step(1.0)
    assert [(p.rank, p.control.num_tokens) for p in ready] == [(0, 2)]
    assert set(ffn.peers) == {0}


# ------------------------------------------------- profiler control and peer state
def test_profile_requests_reach_the_ffn_between_steps(net):
    ffn, att = connected_pair(net)
    assert ffn.take_profile_requests() == []
    att.profile(True)
    peer, x, buf = step_to_ffn(ffn, att, 1, 2)  # the step still arrives after the request
    assert peer.control.num_tokens == 2
    assert ffn.take_profile_requests() == [True]
    assert ffn.take_profile_requests() == []  # taken once
    ffn.send(peer, buf * 2)
    assert torch.equal(att.recv(torch.empty(2, HIDDEN)), x * 2)
    att.end_step()
    att.profile(False)
    wait_until(
        lambda: ffn.wait_step(0.05) == [] and ffn._profile_requests == [False],
        what="profile stop request",
    )
    assert ffn.take_profile_requests() == [False]


def test_peer_states_and_is_up(net):
    port = free_port()
    ffn = net.ffn(port, m=2)
    ffn.start()
    assert ffn.peer_states() == {"attention_rank_0": False, "attention_rank_1": False}
    att = net.attention(port, m=2, rank=1)
    assert not att.is_up()
    Bg(att.connect).get()
    wait_until(lambda: 1 in ffn.peers)
    assert ffn.peer_states() == {"attention_rank_0": False, "attention_rank_1": True}
    assert att.is_up()
    ffn.close()
    with pytest.raises(P.AFDPeerError):
        att.begin_step(1, 1)
        att.recv(torch.empty(1, HIDDEN))
    assert not att.is_up()


def test_dropped_strangers_count_as_handshake_failures(net):
    from vllm.afd import metrics

    ffn, _ = connected_pair(net)
    before = metrics.STATS.counters["handshake_failures"]
    s = net.raw(ffn.addr[1])
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    assert_dropped(s)
    wait_until(
        lambda: metrics.STATS.counters["handshake_failures"] == before + 1,
        what="handshake failure counted",
    )
