"""The control channel composed with a plane of device work (as nixl's device path is on
CUDA), on the CPU with a recording plane and real sockets on 127.0.0.1: the step control is
the plane's (begin_step enqueues it, the plane sends it on through Link.control, and the FFN
rank receives it as any step), the lane of each message is its micro-batch's, a failure the
plane finds (Link.lost) is the loss of the FFN rank (named, its waits released, the engine
ended where no forward re-run holds it), and only the forward's thread rejoins."""

from __future__ import annotations

import dataclasses
import time

import tcp_lib
import torch
from tcp_lib import HIDDEN, Bg, make_ctx, wait_until

from serve_util import free_port, port_bindable
from vllm.afd import protocol as P
from vllm.distributed.afd import tcp
from vllm.distributed.afd.plane import AttentionPlane

net = tcp_lib.net  # the fixture


class DevicePlane(AttentionPlane):
    """Records what the channel asks; its 'device' sends the control when told."""

    carries_control = True
    reruns_forward = True
    dbo_capable = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.controls: list[tuple[int, int]] = []
        self.sent: list[tuple[int, int]] = []  # (lane, rows)
        self.released: list[str] = []
        self.failure: str | None = None

    def begin_step(self, num_tokens, flags):
        self.controls.append((num_tokens, flags))

    def send(self, x, lane=0):
        self.sent.append((lane, x.shape[0]))

    def recv(self, out, lane=0):
        return out

    def recv_start(self, out, lane=0):
        return lambda: out

    def lost(self, why):
        self.released.append(why)

    def step_lost(self):
        return self.failure

    def proxy_sends_control(self):  # what the proxy thread does with a control record
        n, flags = self.controls.pop(0)
        self.link.control(n, flags)


def _pair(net, port, window=0.0):
    ffn = net.ffn(port)
    ffn.start()
    ctx = make_ctx("attention", port)
    ctx.config = dataclasses.replace(ctx.config, rejoin_timeout_s=window)
    att = tcp.TCPAttentionConnector(ctx, DevicePlane(ctx))
    net.items.append(att)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    return ffn, att


def test_the_step_control_is_the_planes_and_reaches_the_ffn_rank(net):
    port = free_port()
    ffn, att = _pair(net, port)
    assert att.reruns_forward and att.checks_every_forward
    att.begin_step(1, 5)
    assert att.plane.controls == [(5, 0)]  # enqueued as device work, nothing sent yet
    assert ffn.wait_step(0.2) == []
    att.plane.proxy_sends_control()
    (peer,) = ffn.wait_step(2.0)
    assert peer.control.type == P.MSG_STEP and peer.control.num_tokens == 5
    att.send(torch.zeros(5, HIDDEN))
    # a micro-batched step: each micro-batch's messages on its own lane
    att.end_step()
    att.begin_step(2, 3, ubatch=(0, 2), ubatch_tokens=[3, 2])
    att.send(torch.zeros(3, HIDDEN))
    att.begin_step(2, 2, ubatch=(1, 2), ubatch_tokens=[3, 2])
    att.send(torch.zeros(2, HIDDEN))
    assert att.plane.sent == [(0, 5), (0, 3), (1, 2)]
    assert att.plane.controls == [(3, P.ubatch_flags(0, 2)), (2, P.ubatch_flags(1, 2))]


def test_a_failure_the_plane_finds_is_the_loss_of_the_peer_and_ends_an_unguarded_rank(net):
    port = free_port()
    ffn, att = _pair(net, port, window=0.0)
    ended: list[str] = []
    att.on_failure = ended.append
    att.plane.link.lost("AFD peer FFN rank 0 did not answer within the timeout (nixl)")
    assert not att.is_up() and att.lost_at() is not None
    assert att.plane.released == ["AFD peer FFN rank 0 did not answer within the timeout (nixl)"]
    assert ended == att.plane.released  # no held re-run (window 0): the engine ends by name
    # a control the proxy still holds for the ended session is refused, not sent
    att.plane.controls.append((4, 0))
    try:
        att.plane.proxy_sends_control()
        raise AssertionError("a control went out on an ended session")
    except P.AFDPeerError as e:
        assert "ended" in str(e)


def test_a_guarded_rank_holds_the_loss_and_only_the_forwards_thread_rejoins(net):
    port = free_port()
    ffn, att = _pair(net, port, window=30.0)
    ended: list[str] = []
    att.on_failure = ended.append
    att.forwards_guarded = True  # as vllm.afd.rejoin.run_forward sets it
    assert att.holds_losses() and att.can_rejoin
    att.plane.failure = "lost AFD peer FFN rank 0: nixl write failed"
    assert att.step_lost() == "lost AFD peer FFN rank 0: nixl write failed"
    assert ended == [] and not att.is_up()  # held, not fatal
    ffn.close()  # the FFN server restarts meanwhile
    wait_until(lambda: port_bindable(port), what="the FFN port free")
    ffn2 = net.ffn(port)
    ffn2.start()
    time.sleep(1.5)  # heartbeats come and go: the background rejoin does not reconnect
    assert not att.is_up() and 0 not in ffn2.peers
    att.plane.failure = None
    att.reconnect(time.monotonic() + 10.0)  # run_forward's rejoin, between forwards
    assert att.is_up() and att.step_lost() is None
    wait_until(lambda: 0 in ffn2.peers, what="the rejoined session")
