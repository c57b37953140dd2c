"""The FFN side of rejoin: an FFN rank survives the loss of one attention rank.

Over real sockets on 127.0.0.1 (the TCP connector, tcp_lib's fakes) and with the FFN
model runner's step loop: a lost attention rank (EOF, reset, a protocol error, between
steps or in the middle of a step that other ranks share) is dropped, the other ranks are
served on - a step in flight included, with the right outputs - and the rank is taken
again on a new handshake of the same rank id (its server restarted). A rejoin of another
deployment (fingerprint) or of a rank still connected is refused; an nccl FFN rank drops
the lost rank alone too, its communicator aborted (a fake PyNccl communicator)."""

from __future__ import annotations

import time

import pytest
import tcp_lib
import test_nccl_connector
import torch
from ffn_fakes import FakeRunner, no_forward_context  # noqa: F401 - the fixture
from tcp_lib import HIDDEN, Bg, kill, serve_one_step, wait_lost, wait_peers, wait_until

from serve_util import free_port
from vllm.afd import protocol as P
from vllm.distributed.afd import tcp
from vllm.distributed.afd.base import StepPeer

net = tcp_lib.net  # the fixture
fake = test_nccl_connector.fake  # the fixture: a fake PyNccl communicator


def attention(net, port: int, rank: int, **kw) -> tcp.TCPAttentionConnector:
    """An attention rank whose process can die: no heartbeat thread (which would notice
    the loss and reconnect on its own); the tests here are shorter than timeout_s."""
    att = net.attention(port, rank=rank, m=2, **kw)
    att._heartbeat_loop = lambda: None
    return att


def two_ranks(net, timeout: float = 5.0):
    port = free_port()
    ffn = net.ffn(port, m=2, timeout=timeout)
    ffn.start()
    atts = [attention(net, port, r, timeout=timeout) for r in (0, 1)]
    for a in atts:
        Bg(a.connect).get()
    wait_until(lambda: set(ffn.peers) == {0, 1}, what="both ranks accepted")
    return port, ffn, atts


@pytest.mark.parametrize("rst", [True, False], ids=["reset", "fin"])
def test_a_lost_rank_is_dropped_and_the_other_served_on(net, rst):
    _, ffn, (att0, att1) = two_ranks(net)
    serve_one_step(ffn, att1, 1)
    kill(att1.sock, rst)
    t0 = time.monotonic()
    assert "lost AFD peer attention rank 1 at 127.0.0.1:" in wait_lost(ffn, 1)
    assert time.monotonic() - t0 < 1.5  # EOF or reset at once, not after timeout_s
    assert ffn.peer_states() == {"attention_rank_0": True, "attention_rank_1": False}
    serve_one_step(ffn, att0, 1)
    serve_one_step(ffn, att0, 2)


def test_the_same_rank_is_taken_again_after_its_server_restarts(net):
    port, ffn, (att0, att1) = two_ranks(net)
    serve_one_step(ffn, att1, 7)
    kill(att1.sock, rst=True)
    t_lost = time.monotonic()
    wait_lost(ffn, 1)
    again = attention(net, port, 1)  # the restarted server: step ids start again
    Bg(again.connect).get()
    wait_until(lambda: 1 in ffn.peers, what="rank 1 accepted again")
    took = time.monotonic() - t_lost
    print(f"attention rank 1: lost -> accepted again in {took * 1e3:.0f} ms")
    assert ffn.peer_states() == {"attention_rank_0": True, "attention_rank_1": True}
    serve_one_step(ffn, again, 1)
    serve_one_step(ffn, att0, 1)
    # and lost again, taken again: as often as it restarts
    kill(again.sock, rst=False)
    wait_lost(ffn, 1)
    third = attention(net, port, 1)
    Bg(third.connect).get()
    wait_until(lambda: 1 in ffn.peers, what="rank 1 accepted a third time")
    serve_one_step(ffn, third, 1)


def test_a_protocol_error_drops_only_that_rank(net):
    _, ffn, (att0, att1) = two_ranks(net)
    att1.begin_step(5, 1)
    wait_peers(ffn, [1])
    with att1._lock:  # a second step id 5: the stream is out of step
        att1.sock.sendall(P.Control(P.MSG_STEP, 5, 1).pack())
    assert "broke the protocol: step id 5 after step 5" in wait_lost(ffn, 1)
    serve_one_step(ffn, att0, 1)


def test_a_rejoin_of_another_deployment_is_refused(net):
    port, ffn, (att0, att1) = two_ranks(net)
    kill(att1.sock, rst=True)
    wait_lost(ffn, 1)
    other = attention(net, port, 1, afd_revision="another-build")
    with pytest.raises(P.AFDHandshakeError, match="fingerprint mismatch on 'afd_revision'"):
        Bg(other.connect).get()
    assert 1 not in ffn.peers
    serve_one_step(ffn, att0, 1)


def test_a_rank_still_connected_cannot_be_replaced(net):
    """A hello is not proof of anything without a shared secret: a second connection of a
    live rank is refused (the attention side retries it while rejoining), the first one
    is served on."""
    port, ffn, (att0, att1) = two_ranks(net)
    dup = attention(net, port, 1)
    with pytest.raises(P.AFDHandshakeError, match="attention rank 1 is already connected"):
        Bg(dup.connect).get()
    serve_one_step(ffn, att1, 1)


def test_an_nccl_ffn_rank_drops_a_lost_rank_alone_and_serves_the_other(fake):
    """Before, a lost attention rank ended an nccl FFN rank (one NCCL group for good);
    with a communicator per session the lost rank's session ends alone, its
    communicator aborted (its pending operations end), and the other rank is served."""
    nt = test_nccl_connector
    port = free_port()
    ffn = nt._ffn(fake, port)
    att0, att1 = nt._attention(fake, port, 0), nt._attention(fake, port, 1)
    nt._connect(att0, att1)
    wait_until(lambda: set(ffn.peers) == {0, 1}, what="both ranks accepted")
    lost, kept = nt._comm_of(ffn, 1), nt._comm_of(ffn, 0)
    att1._heartbeat_loop = lambda: None
    kill(att1.sock, rst=True)
    t0 = time.monotonic()
    assert "lost AFD peer attention rank 1 at 127.0.0.1:" in wait_lost(ffn, 1)
    assert time.monotonic() - t0 < 1.5 and ffn.survives_peer_loss
    wait_until(lambda: lost.destroyed, what="the lost rank's communicator aborted")
    assert not kept.destroyed and set(ffn.peers) == {0}
    nt._step(ffn, att0, 0, 3, step_no=1)


# ------------------------------------------------------- the runner's step in flight
def make_runner(conn, layers: int = 2) -> FakeRunner:
    """The serve loop's step code with two layers (layer i: x * 10 + i); no model."""
    return FakeRunner(conn, layers, HIDDEN)


pytestmark = pytest.mark.usefixtures("no_forward_context")


@pytest.mark.parametrize("at", ["recv", "send"])
def test_a_step_in_flight_goes_on_for_the_other_rank(net, at):
    """Both ranks share one FFN pass; rank 1 dies after layer 0 (before sending layer 1's
    input, or before reading layer 0's output): rank 0 gets every layer's right output,
    rank 1 is dropped, and the next round serves rank 0 alone."""
    _, ffn, (att0, att1) = two_ranks(net)
    runner = make_runner(ffn)
    for a in (att0, att1):
        a.begin_step(1, 2)
    ready = sorted(wait_peers(ffn, [0, 1]).values(), key=lambda p: p.rank)
    step = Bg(runner._run_step, ready)
    x0, x1 = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    att0.send(x0)
    att1.send(x1)
    y0 = att0.recv(torch.empty(2, HIDDEN))
    if at == "send":
        kill(att1.sock, rst=True)
    else:
        assert torch.allclose(att1.recv(torch.empty(2, HIDDEN)), x1 * 10)
    att0.send(y0)
    if at == "recv":
        kill(att1.sock, rst=True)
    out = att0.recv(torch.empty(2, HIDDEN))
    att0.end_step()
    step.get()
    assert torch.allclose(y0, x0 * 10) and torch.allclose(out, x0 * 100 + 1)
    assert runner.peers_lost == 1 and runner._lost == {1}
    assert 1 not in ffn.peers and "attention rank 1" in ffn.lost[1]
    runner._lost.clear()  # the serve loop's next round
    att0.begin_step(2, 3)
    (peer,) = wait_peers(ffn, [0]).values()
    step = Bg(runner._run_step, [peer])
    x = torch.randn(3, HIDDEN)
    att0.send(x)
    att0.send(att0.recv(torch.empty(3, HIDDEN)))
    assert torch.allclose(att0.recv(torch.empty(3, HIDDEN)), x * 100 + 1)
    att0.end_step()
    step.get()


def test_a_rank_lost_in_its_micro_batched_step_leaves_the_plain_step_served():
    """DBO: the later micro-batch's control of rank 0 fails (its session is gone); the
    runner drops rank 0 and serves rank 1's plain step of the same round."""

    class Conn:
        survives_peer_loss = True
        ubatch_controls_upfront = False  # as FFNConnector declares

        def __init__(self):
            self.sent, self.dropped = [], []

        def recv_control(self, peer):
            raise P.AFDPeerError("lost AFD peer attention rank 0: connection closed")

        def recv(self, peer, out):
            out.fill_(peer.rank + 1)

        def send(self, peer, y):
            self.sent.append((peer.rank, y[0, 0].item()))

        def drop_peer(self, peer, why):
            self.dropped.append((peer.rank, why))

    conn = Conn()
    runner = make_runner(conn, layers=1)
    dbo = P.Control(P.MSG_STEP, 4, 2, P.ubatch_flags(0, 2))
    runner._run_step([StepPeer(0, dbo), StepPeer(1, P.Control(P.MSG_STEP, 9, 3))])
    assert conn.dropped == [(0, "lost AFD peer attention rank 0: connection closed")]
    # rank 0's first micro-batch was served before its second control failed
    assert conn.sent == [(0, 10.0), (1, 20.0)]
    assert runner._lost == {0} and runner.peers_lost == 1


def test_the_serve_loop_serves_on_after_a_rank_breaks_the_protocol(net):
    """The serve loop itself (FFNModelRunner._serve in its thread, as the FFN server runs
    it): rank 1 breaks the protocol (a step id repeated), then, restarted, again (a step
    opened by its second micro-batch); each time only rank 1's session ends, the loop keeps
    running (no error, no on_fatal) and rank 0's steps get their right outputs.
    docs/security.md and docs/operations.md said a protocol break (or a lost attention
    rank) ended the FFN."""
    import threading

    port, ffn, (att0, att1) = two_ranks(net, timeout=30.0)
    runner = make_runner(ffn)
    runner._stop = threading.Event()
    runner.group, runner.error, runner.on_fatal = None, None, []
    runner._profile_lock, runner._profile_local = threading.Lock(), []
    runner._settle = lambda: None
    fatal: list[str] = []
    runner.on_fatal.append(fatal.append)
    loop = threading.Thread(target=runner._serve, daemon=True)
    loop.start()

    def step(att, step_id):
        att.begin_step(step_id, 2)
        x = torch.randn(2, HIDDEN)
        att.send(x)
        y = att.recv(torch.empty(2, HIDDEN))
        att.send(y)
        out = att.recv(torch.empty(2, HIDDEN))
        att.end_step()
        assert torch.allclose(y, x * 10) and torch.allclose(out, x * 100 + 1)

    try:
        step(att0, 1)
        step(att1, 1)
        with att1._lock:  # step id 1 again: the stream is out of step
            att1.sock.sendall(P.Control(P.MSG_STEP, 1, 2).pack())
        wait_until(lambda: 1 not in ffn.peers, 5.0, "rank 1 dropped")
        assert "broke the protocol: step id 1 after step 1" in ffn.lost[1]
        step(att0, 2)
        again = attention(net, port, 1, timeout=30.0)  # its server restarted
        Bg(again.connect).get()
        wait_until(lambda: 1 in ffn.peers, 5.0, "rank 1 taken again")
        with again._lock:  # a step opened by its second micro-batch
            again.sock.sendall(P.Control(P.MSG_STEP, 7, 2, P.ubatch_flags(1, 2)).pack())
        wait_until(lambda: 1 not in ffn.peers, 5.0, "rank 1 dropped again")
        assert "step 7 opened with micro-batch 1 of 2" in ffn.lost[1]
        step(att0, 3)
        assert loop.is_alive() and runner.error is None and fatal == []
    finally:
        runner._stop.set()
        loop.join(5)
