"""The nixl data plane on the control channel (vllm.distributed.afd.nixl), with real NIXL
agents (UCX) and real sockets on 127.0.0.1: layer exchanges of one and two attention ranks,
micro-batched receives waited out of order, a restarted FFN rank met as a new agent (rejoin),
a peer that is not a nixl FFN server refused by name, and registrations that end with the
session; the agent's kept requests against a stand-in NIXL whose posts fail on demand."""

from __future__ import annotations

import time

import pytest
import torch
from tcp_lib import HIDDEN, Bg, make_ctx, wait_peers, wait_until

from serve_util import free_port
from vllm.afd import protocol as P
from vllm.distributed.afd import nixl
from vllm.distributed.afd.base import (
    StepPeer,
    create_attention_connector,
    create_ffn_connector,
)


@pytest.fixture
def made():
    items = []
    yield items
    for c in reversed(items):
        try:
            c.close()
        except Exception:
            pass


def _ffn(made, port, **kw):
    c = create_ffn_connector(make_ctx("ffn", port, connector="nixl", **kw))
    made.append(c)
    c.start()
    return c


def _att(made, port, **kw):
    c = create_attention_connector(make_ctx("attention", port, connector="nixl", **kw))
    made.append(c)
    return c


def _layer(att, ffn, peer, t, dtype, bias):
    """One layer's exchange. Each role drives its own agent's progress while it waits (no
    progress thread), as its own process would: the FFN side serves from a thread."""
    x = torch.randn(t, HIDDEN).to(dtype)
    buf = torch.empty(t, HIDDEN, dtype=dtype)

    def serve():
        ffn.recv(peer, buf)
        ffn.send(peer, buf + bias)

    server = Bg(serve)
    att.send(x)
    out = torch.empty(t, HIDDEN, dtype=dtype)
    assert att.recv(out) is out
    server.get()
    assert torch.equal(buf, x)
    assert torch.equal(out, x + bias)


def test_registry_composes_the_channel_with_the_nixl_plane(made):
    port = free_port()
    ffn = _ffn(made, port)
    att = _att(made, port)
    assert isinstance(att.plane, nixl.NixlAttentionPlane)
    assert isinstance(ffn.plane, nixl.NixlFFNPlane)
    # graphs on the attention side (device path); the FFN host loop takes part in each
    # hand-over, so its passes are not captured
    assert att.dbo_capable and att.graph_capable and not ffn.graph_capable
    assert ffn.survives_peer_loss and not att.reruns_forward  # CPU: host-driven


@pytest.mark.parametrize("dtype,kept", [(torch.float32, nixl.XFER_CACHE),
                                         (torch.bfloat16, nixl.XFER_CACHE), (torch.float32, 2)])
def test_1a1f_steps_move_through_nixl_writes(made, dtype, kept, monkeypatch):
    """Every message arrives whole in its own slot; a write that recurs (same slots, same
    size) posts the kept request again with its new notification; with room for only
    ``kept`` requests the least recently used are released and made again."""
    monkeypatch.setattr(nixl, "XFER_CACHE", kept)
    port = free_port()
    ffn = _ffn(made, port)
    att = _att(made, port)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    # more steps than inbox slots: the slots are reused in turn
    for step in range(1, 4 * nixl.SLOTS):
        t = 1 + step % 2
        att.begin_step(step, t)
        (peer,) = wait_peers(ffn, [0]).values()
        for layer in range(2):
            _layer(att, ffn, peer, t, dtype, bias=layer + 1)
        att.end_step()
        assert att.plane.agent.kept() <= kept and ffn.plane.agent.kept() <= kept
    assert len(ffn.plane.sessions) == 1
    if kept > 2 * nixl.SLOTS:  # the sizes and slots recur: most posts are reposts
        for agent in (att.plane.agent, ffn.plane.agent):
            assert agent.reposts > 2 * nixl.SLOTS and agent.kept() <= 2 * nixl.SLOTS
    att.close()
    wait_until(lambda: not ffn.wait_step(0.05) and 0 not in ffn.peers, what="goodbye")
    assert ffn.plane.sessions == {}  # the session's registrations ended with it
    assert ffn.plane.agent.kept() == 0  # and the requests into them


class _ScriptedNixl:
    """A stand-in NIXL agent whose requests end as the test says: ``outcome`` is the state
    each post leaves its request in."""

    def __init__(self, name, config):
        self.outcome, self.states, self.posts, self.released = "DONE", {}, [], []
        self.checks = 0

    def get_xfer_descs(self, descs, mem):
        return descs

    def initialize_xfer(self, op, src, dst, peer, note):
        handle = len(self.states)
        self.states[handle] = "INIT"
        return handle

    def transfer(self, handle, note=b""):
        self.posts.append(handle)
        self.states[handle] = self.outcome
        return "PROC"

    def check_xfer_state(self, handle):
        self.checks += 1
        return self.states[handle]

    def release_xfer_handle(self, handle):
        self.released.append(handle)


def test_a_kept_request_whose_post_failed_is_made_anew_and_kept(monkeypatch):
    """A kept request whose last post ended in ERR is released and replaced by the next
    write's new request, which is kept and posted again from then on (before: the failed
    one stayed kept and every later write of that slot built a request of its own); the
    failed request's state is read once on the way."""
    monkeypatch.setattr(nixl, "load_nixl", lambda: (_ScriptedNixl, lambda **kw: kw))
    agent = nixl.Agent("attention", 0, "UCX")
    fake = agent.agent
    slots = ((1, 0, "DRAM"), (2, 0, "DRAM"), 64, "peer")

    def write(note):
        return agent.write(*slots, note=note, who="FFN rank 0")

    first = write("a")
    fake.outcome = "ERR"
    write("b")  # a repost of the kept request, which fails
    with pytest.raises(nixl.AFDPeerError, match="a nixl write failed"):
        agent.done(first, "FFN rank 0")
    fake.outcome = "DONE"
    checks = fake.checks
    second = write("c")
    assert second is not first and fake.released == [first.handle]
    assert fake.checks == checks + 1  # the failed request's state read once, not again
    assert agent.kept() == 1 and agent.done(second, "FFN rank 0")
    third = write("d")
    assert third is second and agent.reposts == 2
    assert fake.posts == [first.handle, first.handle, second.handle, second.handle]


def test_micro_batch_replies_are_taken_as_claimed_whatever_order_waited(made):
    port = free_port()
    ffn = _ffn(made, port)
    att = _att(made, port)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    att.begin_step(1, 3, ubatch=(0, 2))
    (peer,) = wait_peers(ffn, [0]).values()
    xs = [torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)]
    outs = [torch.empty(3, HIDDEN), torch.empty(3, HIDDEN)]

    def serve():
        for i in range(2):
            p = peer
            if i:  # the FFN runner serves a later micro-batch as a peer of its own control
                ctrl = ffn.recv_control(peer)
                assert ctrl.flags == P.ubatch_flags(1, 2)
                p = StepPeer(peer.rank, ctrl)
            buf = torch.empty(3, HIDDEN)
            ffn.recv(p, buf)
            ffn.send(p, buf * 10 + i)

    server = Bg(serve)
    att.send(xs[0])
    w0 = att.recv_start(outs[0])
    att.begin_step(1, 3, ubatch=(1, 2))
    att.send(xs[1])
    w1 = att.recv_start(outs[1])
    assert torch.equal(w1(), xs[1] * 10 + 1)  # waited first, still micro-batch 1's reply
    assert torch.equal(w0(), xs[0] * 10)
    server.get()
    att.end_step()


def test_two_attention_ranks_share_one_ffn_agent(made):
    port = free_port()
    ffn = _ffn(made, port, m=2)
    atts = [_att(made, port, m=2, rank=r) for r in range(2)]
    for a in atts:
        Bg(a.connect).get()
    wait_until(lambda: {0, 1} <= set(ffn.peers))
    for a in atts:
        a.begin_step(1, 2)
    peers = wait_peers(ffn, [0, 1])
    for r, a in enumerate(atts):
        _layer(a, ffn, peers[r], 2, torch.float32, bias=r)
        a.end_step()


def test_a_restarted_ffn_rank_is_a_new_agent_and_the_rank_rejoins(made):
    port = free_port()
    ffn = _ffn(made, port, timeout=3.0)
    att = _att(made, port, timeout=3.0)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    first = att.plane.session.peer_agent
    ffn.close()
    wait_until(lambda: not att.is_up(), what="loss noticed by the heartbeat")
    ffn2 = _ffn(made, port, timeout=3.0)
    att.reconnect(time.monotonic() + 10)
    wait_until(lambda: 0 in ffn2.peers)
    assert att.plane.session.peer_agent not in (first, None)
    assert first != ffn2.plane.agent.name
    att.begin_step(7, 4)
    (peer,) = wait_peers(ffn2, [0]).values()
    _layer(att, ffn2, peer, 4, torch.float32, bias=3)
    att.end_step()


def test_a_gloo_ffn_server_is_refused_by_name(made):
    """An attention rank of connector nixl meets an FFN rank of another connector: the
    fingerprint names the connector, before any nixl metadata is sent."""
    port = free_port()
    from vllm.distributed.afd import tcp

    ffn = tcp.TCPFFNConnector(make_ctx("ffn", port))
    made.append(ffn)
    ffn.start()
    att = _att(made, port, timeout=1.0)
    with pytest.raises(P.AFDHandshakeError, match=r"connector.*'nixl'.*'gloo'|connector.*'gloo'.*'nixl'"):
        att.connect()
    assert att.plane.session is None
