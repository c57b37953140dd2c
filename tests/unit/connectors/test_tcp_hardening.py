"""Hardening of the TCP connector over real sockets:
descriptors >= 1024, the handshake cap and thread-start failures, accept() backoff, the
device-channel setup outside the connector lock, steps that fail part-way, the
challenge-response authentication and text from a peer in logs and errors."""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time

import pytest
import tcp_lib
import torch
from tcp_lib import (
    HIDDEN,
    HOST,
    Bg,
    connected_pair,
    fingerprint,
    make_ctx,
    serve_one_step,
    wait_lost,
    wait_peers,
    wait_until,
)
from test_afd_channel import high_descriptors

from serve_util import free_port
from vllm.afd import protocol as P
from vllm.distributed.afd import channel, plane, tcp

net = tcp_lib.net  # the fixture


def read_hello(sock: socket.socket, timeout: float = 5.0) -> dict | None:
    """The next hello on ``sock``, None at EOF/reset."""
    try:
        return channel.recv_hello(sock, time.monotonic() + timeout, "test")
    except P.AFDPeerError as e:
        if "did not answer" in str(e):
            raise
        return None


class Logged:
    """Messages of tcp.logger at one level (monkeypatched)."""

    def __init__(self, monkeypatch, *levels):
        self.lines: list[tuple[str, str]] = []
        for level in levels:
            monkeypatch.setattr(tcp.logger, level, self._record(level))

    def _record(self, level):
        def log(msg, *args, **kw):
            self.lines.append((level, msg % args if args else msg))

        return log

    def having(self, text: str) -> list[str]:
        return [m for _, m in self.lines if text in m]


# ------------------------------------------------------- item 2: descriptors >= 1024
def test_ffn_serves_a_peer_whose_socket_descriptor_is_above_1024(net):
    """select() refuses descriptors >= 1024 with ValueError, which wait_step took for "no
    steps": the FFN served nothing and never dropped the peer."""
    fillers = high_descriptors()
    try:
        ffn, att = connected_pair(net)
        assert ffn.peers[0].sock.fileno() >= 1024
        serve_one_step(ffn, att, 1)
        att.close()  # goodbye: read from the same socket
        wait_until(lambda: ffn.wait_step(0.05) == [] and 0 not in ffn.peers, what="goodbye")
    finally:
        for fd in fillers:
            os.close(fd)


# ----------------------------------------------- item 3: the handshake cap, no thread
def _is_handshake_thread(thread: threading.Thread) -> bool:
    target = getattr(thread, "_target", None)
    return getattr(target, "__func__", None) is tcp.TCPFFNConnector._handshake


def test_accept_survives_failing_to_start_a_handshake_thread(net, monkeypatch):
    real_start = threading.Thread.start
    failed = []

    def start(self):
        if _is_handshake_thread(self) and len(failed) < 2:
            failed.append(self)
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    port = free_port()
    ffn = net.ffn(port, timeout=5.0)
    ffn.start()
    for _ in range(2):
        s = net.raw(port)
        reply = read_hello(s)  # answered "busy" and closed at once
        assert reply is not None and reply["status"] == P.STATUS_BUSY
        assert read_hello(s) is None
    assert len(failed) == 2
    att = net.attention(port, timeout=5.0)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    assert ffn._handshakes == 0  # every slot given back
    serve_one_step(ffn, att, 1)


def test_handshakes_beyond_the_cap_are_refused_at_once(net, monkeypatch):
    """32 silent strangers fill the cap; the 33rd connection is answered busy at once, one
    log line says so, and a real attention rank gets in when the strangers time out."""
    logged = Logged(monkeypatch, "warning")
    port = free_port()
    ffn = net.ffn(port, timeout=2.5)  # strangers are dropped after min(10, 2.5) s
    ffn.start()
    strangers = [net.raw(port) for _ in range(tcp.TCPFFNConnector.MAX_HANDSHAKES)]
    wait_until(lambda: ffn._handshakes == ffn.MAX_HANDSHAKES, what="cap filled")
    t0 = time.monotonic()
    extra = net.raw(port)
    reply = read_hello(extra)
    assert reply is not None and reply["status"] == P.STATUS_BUSY
    assert time.monotonic() - t0 < 0.5
    att = net.attention(port, timeout=10.0)
    Bg(att.connect).get(15)
    wait_until(lambda: 0 in ffn.peers)
    for s in strangers:
        tcp_lib.assert_dropped(s)
    refusals = logged.having("refused connection from")
    assert len(refusals) == 1, refusals  # rate-limited: the attention's retries are not logged
    assert "32 handshakes in progress" in refusals[0]


# --------------------------------------------------- item 4: accept() out of descriptors
class EMFILEListener:
    def __init__(self):
        self.calls = 0

    def settimeout(self, t):
        pass

    def accept(self):
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self):
        pass


def test_accept_backs_off_when_out_of_descriptors(monkeypatch):
    logged = Logged(monkeypatch, "error")
    ffn = tcp.TCPFFNConnector(make_ctx("ffn", free_port()))
    ffn.listener = lst = EMFILEListener()
    loop = threading.Thread(target=ffn._accept_loop, daemon=True)
    cpu0, t0 = time.process_time(), time.monotonic()
    loop.start()
    wait_until(lambda: lst.calls >= 3, what="three accept attempts")
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))  # a one-second window
    calls, cpu, elapsed = lst.calls, time.process_time() - cpu0, time.monotonic() - t0
    ffn._stop.set()
    loop.join(3)
    assert not loop.is_alive()  # the backoff wait ends with close()
    # tries at 0, 0.1, 0.3, 0.7, 1.5, 2.5 ... s (waits doubling from 0.1 s up to 1 s)
    schedule = [0.0, 0.1, 0.3, 0.7] + [1.5 + k for k in range(60)]
    assert calls <= 1 + sum(t <= elapsed for t in schedule), (calls, elapsed)
    assert cpu < 0.5, f"{cpu:.2f} s of CPU in {elapsed:.1f} s"
    lines = logged.having("cannot accept connections")
    assert len(lines) == 1 and "Too many open files" in lines[0], lines


# --------------------------------------- item 5: device channel outside the lock
class SlowDeviceFFN(tcp.TCPFFNConnector):
    """Its device-channel setup for attention rank 1 blocks until released (a peer that
    stalls the cuda_ipc buffer exchange), or fails once."""

    def __init__(self, ctx, fail_once=False):
        super().__init__(ctx)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail_once = fail_once

    def _accept_device(self, rank, sock, addr):
        if rank != 1:
            return
        if self.fail_once:
            self.fail_once = False
            raise RuntimeError("cannot map buffers")
        self.entered.set()
        self.release.wait(5.0)


def _two_ranks_slow(net, **kw):
    port = free_port()
    ffn = SlowDeviceFFN(make_ctx("ffn", port, m=2, timeout=5.0), **kw)
    net.items.append(ffn)
    ffn.start()
    a0 = net.attention(port, rank=0, m=2, timeout=5.0)
    Bg(a0.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    return port, ffn, a0


def test_a_stalled_device_exchange_does_not_freeze_the_other_ranks(net):
    port, ffn, a0 = _two_ranks_slow(net)
    a1 = net.attention(port, rank=1, m=2, timeout=5.0)
    Bg(a1.connect).get()  # the hello is answered before the device channel is set up
    assert ffn.entered.wait(5)
    for step_id in (1, 2):
        t0 = time.monotonic()
        assert ffn.wait_step(0.1) == []
        assert time.monotonic() - t0 < 1.0, "wait_step waited for the device exchange"
        serve_one_step(ffn, a0, step_id)
    dup = net.attention(port, rank=1, m=2, timeout=5.0)
    with pytest.raises(P.AFDHandshakeError, match="attention rank 1 is already connected"):
        Bg(dup.connect).get()
    assert 1 not in ffn.peers
    ffn.release.set()
    wait_until(lambda: 1 in ffn.peers)
    serve_one_step(ffn, a1, 1)


def test_a_failed_device_exchange_gives_the_rank_back(net):
    port, ffn, _ = _two_ranks_slow(net, fail_once=True)
    first = net.attention(port, rank=1, m=2, timeout=5.0)
    Bg(first.connect).get()
    wait_until(lambda: not ffn._joining, what="reservation undone")
    assert 1 not in ffn.peers
    ffn.release.set()
    again = net.attention(port, rank=1, m=2, timeout=5.0)
    Bg(again.connect).get()
    wait_until(lambda: 1 in ffn.peers)
    serve_one_step(ffn, again, 1)


# ----------------------------------------------- item 6: a step that fails half-way
def _assert_dead_and_ffn_sees_eof(ffn, att, peer=None):
    with pytest.raises(P.AFDPeerError, match="failed part-way"):
        att.begin_step(99, 1)
    assert not att.is_up()
    t0 = time.monotonic()
    if peer is not None:
        with pytest.raises(P.AFDPeerError, match="lost AFD peer attention rank 0"):
            ffn.recv(peer, torch.empty(4, HIDDEN))
    else:
        assert "lost AFD peer attention rank 0" in wait_lost(ffn, 0)
    assert time.monotonic() - t0 < 1.5  # EOF at once, not after timeout_s


def test_any_exception_mid_step_kills_the_attention_connection(net):
    ffn, att = connected_pair(net, timeout=5.0)
    att.begin_step(1, 4)
    (peer,) = wait_peers(ffn, [0]).values()
    with pytest.raises(AttributeError):
        att.send("not a tensor")  # not an AFDPeerError
    _assert_dead_and_ffn_sees_eof(ffn, att, peer)


def test_an_exception_in_a_background_receive_kills_the_connection(net, monkeypatch):
    ffn, att = connected_pair(net, timeout=5.0)
    att.begin_step(1, 4, ubatch=(0, 2))
    (peer,) = wait_peers(ffn, [0]).values()

    def broken(*a, **k):
        raise ValueError("staging failed")

    with monkeypatch.context() as m:
        m.setattr(plane, "recv_tensor", broken)
        wait = att.recv_start(torch.empty(4, HIDDEN))
        with pytest.raises(ValueError, match="staging failed"):
            wait()
    _assert_dead_and_ffn_sees_eof(ffn, att, peer)


@pytest.mark.parametrize(
    "first, second, error",
    [
        ((1, None), (2, None), "step 2 begun while step 1 is open"),
        ((1, (0, 2)), (2, (0, 2)), "step 2 micro-batch 0 of 2 begun while step 1 is open"),
        ((1, (0, 2)), (1, (0, 2)), "step 1 micro-batch 0 of 2 begun while step 1 is open"),
        (None, (3, (1, 2)), "step 3 micro-batch 1 of 2 opened no step"),
    ],
)
def test_begin_step_refused_while_a_step_is_open(net, first, second, error):
    ffn, att = connected_pair(net, timeout=5.0)
    if first is not None:
        att.begin_step(first[0], 4, ubatch=first[1])
        wait_peers(ffn, [0])
    with pytest.raises(P.AFDProtocolError, match=error):
        att.begin_step(second[0], 4, ubatch=second[1])
    _assert_dead_and_ffn_sees_eof(ffn, att)


def test_micro_batches_and_steps_in_order_are_accepted(net):
    ffn, att = connected_pair(net)
    att.begin_step(1, 2, ubatch=(0, 2))
    att.begin_step(1, 3, ubatch=(1, 2))
    att.end_step()
    (peer,) = wait_peers(ffn, [0]).values()
    assert P.ubatch_of(ffn.recv_control(peer).flags) == (1, 2)
    serve_one_step(ffn, att, 2)
    assert att.is_up()


def _controls(step_id, ubatch=None):
    flags = P.ubatch_flags(*ubatch) if ubatch else 0
    return P.Control(P.MSG_STEP, step_id, 1, flags).pack()


@pytest.mark.parametrize(
    "wire, error",
    [
        ([(5, None), (5, None)], "step id 5 after step 5"),
        ([(5, None), (4, None)], "step id 4 after step 5"),
        ([(7, (0, 2)), (8, (1, 2))], "micro-batch 1 of 2 of step 7 was due"),
        ([(7, (0, 2)), (9, None)], "micro-batch 1 of 2 of step 7 was due"),
        ([(7, (1, 2))], "step 7 opened with micro-batch 1 of 2"),
    ],
)
def test_ffn_refuses_step_ids_out_of_order(net, wire, error):
    """The FFN rank checks the step ids of one peer; a stream out of step drops it."""
    ffn, att = connected_pair(net)
    with att._lock:  # not between two heartbeat bytes
        for step_id, ubatch in wire:
            att.sock.sendall(_controls(step_id, ubatch))
    assert re.search(f"broke the protocol: .*{error}", wait_lost(ffn, 0))


# ---------------------------------------------------- item 10: authentication
def _secrets(monkeypatch, ffn_secret, attention_secret):
    for name, value in (
        ("AFD_TEST_FFN_SECRET", ffn_secret),
        ("AFD_TEST_ATT_SECRET", attention_secret),
    ):
        if value:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    return {"secret_env": "AFD_TEST_FFN_SECRET"}, {"secret_env": "AFD_TEST_ATT_SECRET"}


def test_matching_secrets_authenticate_and_the_state_is_logged(net, monkeypatch):
    logged = Logged(monkeypatch, "info", "warning")
    ffn_extra, att_extra = _secrets(monkeypatch, "s3cret-value", "s3cret-value")
    port = free_port()
    ffn = net.ffn(port, extra=ffn_extra)
    ffn.start()
    att = net.attention(port, extra=att_extra)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    serve_one_step(ffn, att, 1)
    required = logged.having("AFD: authentication required")
    assert len(required) == 2, logged.lines  # both sides say so at start
    assert any("$AFD_TEST_FFN_SECRET" in m for m in required)
    assert any("$AFD_TEST_ATT_SECRET" in m for m in required)
    assert not any("s3cret-value" in m for _, m in logged.lines)


def test_without_secrets_both_sides_warn_that_authentication_is_off(net, monkeypatch):
    logged = Logged(monkeypatch, "info", "warning")
    ffn_extra, att_extra = _secrets(monkeypatch, None, None)
    port = free_port()
    ffn = net.ffn(port, extra=ffn_extra)
    ffn.start()
    att = net.attention(port, extra=att_extra)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    off = [m for level, m in logged.lines if level == "warning" and "authentication off" in m]
    assert len(off) == 2, logged.lines


def test_attention_with_a_secret_refuses_an_ffn_without_one(net, monkeypatch):
    ffn_extra, att_extra = _secrets(monkeypatch, None, "only-here")
    port = free_port()
    ffn = net.ffn(port, extra=ffn_extra)
    ffn.start()
    att = net.attention(port, extra=att_extra)
    with pytest.raises(
        P.AFDHandshakeError,
        match=r"does not require authentication .* set the same AFD_TEST_ATT_SECRET on the FFN",
    ):
        Bg(att.connect).get()
    assert ffn.wait_step(0.1) == [] and ffn.peers == {}  # refused on the FFN side too


def test_ffn_with_a_secret_refuses_an_attention_without_one(net, monkeypatch):
    ffn_extra, att_extra = _secrets(monkeypatch, "only-there", None)
    port = free_port()
    ffn = net.ffn(port, extra=ffn_extra)
    ffn.start()
    att = net.attention(port, extra=att_extra)
    with pytest.raises(
        P.AFDHandshakeError,
        match="requires authentication but this attention rank has no shared secret: set "
        "AFD_TEST_ATT_SECRET",
    ):
        Bg(att.connect).get()
    # a stranger that claims no secret is told so by the FFN
    s = net.raw(port)
    s.sendall(P.pack_hello({**fingerprint(), "role": "attention", "rank": 0}))
    reply = read_hello(s)
    assert reply["status"] == tcp.AUTH_MISSING and reply["auth"] == P.AUTH_REQUIRED


def test_a_recorded_attention_answer_cannot_be_replayed(net, monkeypatch):
    ffn_extra, att_extra = _secrets(monkeypatch, "shared", "shared")
    sent = []
    real = tcp.send_hello
    monkeypatch.setattr(tcp, "send_hello", lambda s, p, *a: (sent.append(p), real(s, p, *a)))
    port = free_port()
    ffn = net.ffn(port, extra=ffn_extra)
    ffn.start()
    att = net.attention(port, extra=att_extra)
    Bg(att.connect).get()
    hello = next(p for p in sent if p.get("role") == "attention")
    answer = next(p for p in sent if set(p) == {"proof"})
    first_nonce = next(p["nonce"] for p in sent if p.get("status") == P.STATUS_CHALLENGE)
    att.close()  # free the slot: the replay would take it
    wait_until(lambda: ffn.wait_step(0.05) == [] and 0 not in ffn.peers, what="goodbye")
    s = net.raw(port)
    s.sendall(P.pack_hello(hello))
    challenge = read_hello(s)
    assert challenge["status"] == P.STATUS_CHALLENGE
    assert P.is_nonce(challenge["nonce"]) and challenge["nonce"] != first_nonce
    s.sendall(P.pack_hello(answer))
    assert read_hello(s)["status"] == tcp.AUTH_DIFFERS
    assert 0 not in ffn.peers


class FakeFFN(threading.Thread):
    """Listens on a port and answers one attention rank as ``respond`` says."""

    def __init__(self, respond):
        super().__init__(daemon=True)
        self.lst = socket.create_server((HOST, 0))
        self.port = self.lst.getsockname()[1]
        self.respond = respond
        self.got: list[dict] = []
        self.start()

    def run(self):
        conn, _ = self.lst.accept()
        with conn:
            self.respond(self, conn)
        self.lst.close()

    def read(self, conn):
        msg = read_hello(conn)
        if msg is not None:
            self.got.append(msg)
        return msg


def _head(status, auth=P.AUTH_REQUIRED, **more):
    return {"role": "ffn", "rank": 0, "protocol": P.PROTOCOL_VERSION, "auth": auth,
            "status": status, **more}  # fmt: skip


def test_attention_refuses_an_ffn_that_cannot_prove_the_secret(net, monkeypatch):
    _, att_extra = _secrets(monkeypatch, None, "shared")
    ffn_nonce = P.new_nonce()

    def impostor(fake, conn):
        fake.read(conn)
        conn.sendall(P.pack_hello(_head(P.STATUS_CHALLENGE, nonce=ffn_nonce)))
        fake.read(conn)
        ok = {**fingerprint(), **_head(P.STATUS_OK), "proof": "0" * 64}
        conn.sendall(P.pack_hello(ok))
        fake.read(conn)

    fake = FakeFFN(impostor)
    att = net.attention(fake.port, extra=att_extra)
    with pytest.raises(P.AFDHandshakeError, match=r"did not prove the shared secret \(\$AFD_TEST"):
        Bg(att.connect).get()
    fake.join(5)
    hello, answer = fake.got
    # the attention's proof is bound to both nonces of this connection
    assert answer["proof"] == P.auth_proof("shared", "attention", 0, 0, hello["nonce"], ffn_nonce)
    assert att.sock is None


def test_attention_refuses_an_ffn_that_skips_authentication(net, monkeypatch):
    _, att_extra = _secrets(monkeypatch, None, "shared")

    def skips(fake, conn):
        fake.read(conn)
        conn.sendall(P.pack_hello({**fingerprint(), **_head(P.STATUS_OK, P.AUTH_NONE)}))
        fake.read(conn)

    fake = FakeFFN(skips)
    att = net.attention(fake.port, extra=att_extra)
    with pytest.raises(P.AFDHandshakeError, match="does not require authentication"):
        Bg(att.connect).get()
    fake.join(5)
    assert len(fake.got) == 1  # no proof sent to it


# ---------------------------------------- item 13: text and numbers from a peer
def test_peer_status_text_is_escaped_and_bounded(net):
    evil = "refused\n\x1b[31mERROR forged log line\r" + "x" * 5000

    def refuses(fake, conn):
        fake.read(conn)
        conn.sendall(P.pack_hello(_head(evil, P.AUTH_NONE)))

    fake = FakeFFN(refuses)
    att = net.attention(fake.port)
    with pytest.raises(P.AFDHandshakeError) as ei:
        Bg(att.connect).get()
    msg = str(ei.value)
    assert "refused\\n\\x1b[31mERROR forged log line\\r" in msg
    assert not any(c in msg for c in "\n\r\x1b")
    assert len(msg) < 600 and f"({len(evil)} characters)" in msg


def test_hello_with_a_huge_integer_is_dropped_as_not_this_protocol(net, monkeypatch):
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_type))
    ffn, att = connected_pair(net)
    body = b'{"role": "attention", "rank": ' + b"9" * 5000 + b"}"
    s = net.raw(ffn.addr[1])
    logged = Logged(monkeypatch, "warning")
    s.sendall(P.HELLO_PREAMBLE.pack(P.HELLO_MAGIC, len(body)) + body)
    tcp_lib.assert_dropped(s)
    wait_until(lambda: logged.having("hello is not JSON"), what="drop logged")
    assert errors == []
    serve_one_step(ffn, att, 1)


# ------------------------------------------------- timeout_s at the bounds of its key
@pytest.mark.parametrize("timeout", [0.5, 86400.0])
def test_timeouts_at_the_config_bounds_connect_and_serve(net, timeout):
    """timeout_s is bounded at config time (vllm.config.afd.TIMEOUT_S_RANGE): at either
    bound both sides connect and serve. 1e10 overflowed settimeout at connect."""
    ffn, att = connected_pair(net, timeout=timeout)
    serve_one_step(ffn, att, 1)
    time.sleep(0.3)  # heartbeats every min(1 s, timeout_s / 4) meanwhile
    serve_one_step(ffn, att, 2)
    assert att.is_up() and 0 in ffn.peers


# --------------------------------------- profiler requests to an FFN without a profiler
def test_profile_requests_to_an_ffn_without_a_profiler_do_not_flood_its_log(net, monkeypatch):
    """Any attention rank (any holder of a slot) can send MSG_PROFILE at will; an FFN
    server without a torch profiler answered each with a WARNING (200 requests: 200
    lines). Now one line per 10 s, the next one counting those left out."""
    from ffn_fakes import FakeRunner

    from vllm.afd import ffn_runner

    lines: list[str] = []
    monkeypatch.setattr(ffn_runner.logger, "warning",
                        lambda msg, *a, **k: lines.append(msg % a))  # fmt: skip
    if hasattr(ffn_runner, "_LOG_NO_PROFILER"):  # a fresh throttle: no earlier test's lines
        monkeypatch.setattr(ffn_runner, "_LOG_NO_PROFILER", P.LogThrottle())
    ffn, att = connected_pair(net)
    runner = FakeRunner(ffn)  # vllm_config None: no profiler configured
    for i in range(200):
        att.profile(i % 2 == 0)
    served = 0
    deadline = time.monotonic() + 10
    while served < 200:  # as the serve loop does between steps
        assert time.monotonic() < deadline, f"{served} of 200 profiler requests arrived"
        ffn.wait_step(0.05)
        for start in ffn.take_profile_requests():
            runner._profile(start)
            served += 1
    assert len(lines) == 1, (len(lines), lines[:2])
    assert "has no torch profiler configured" in lines[0]
    serve_one_step(ffn, att, 1)
