"""The control channel composed with a plane of device sessions (``device_session``,
``polls_steps``: cuda_ipc), on the CPU with cuda_ipc's buffers as CPU tensors (the fakes of
test_cuda_ipc_rejoin): the channel passes the step's calls through to the plane and keeps
no open step (a captured graph's step never reaches end_step on the host), the plane's
members are the connector's (read and written through), the rejoin hooks differ from
nixl's where cuda_ipc's did, and the FFN side's generation, micro-batch announcement and
release of a lost session's waits are the plane's."""

from __future__ import annotations

import socket

import pytest
import test_cuda_ipc_rejoin as rj
import torch

from vllm.afd import failure
from vllm.afd.protocol import AFDProtocolError
from vllm.distributed.afd import cuda_ipc as ipc
from vllm.distributed.afd import ipc_kernels as kernels
from vllm.distributed.afd.channel import Peer


@pytest.fixture
def launches(monkeypatch):
    calls: list[str] = []
    for name in ("signal", "control", "wait", "signal_via", "control_via", "copy_via"):
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, **k: calls.append(_n))
    return calls


def test_steps_pass_through_without_an_open_step_on_the_host(monkeypatch, launches):
    """The GPU tests (and a replayed graph) begin steps without end_step: the channel
    refuses that for gloo ("begun while step ... is open"), never for a device session."""
    rj.fake_device(monkeypatch.setattr)
    att, ffn = rj.connected(rejoin_on=False)
    x = torch.ones((3, rj.HIDDEN), dtype=torch.bfloat16)
    for step in (1, 1, 2):  # the same step id again, as a replay's step does
        att.begin_step(step, 3)
        att.send(x)
    assert launches == ["control", "signal"] * 3 and att._step is None
    with pytest.raises(AFDProtocolError, match="3 micro-batches per step, the connector has 2"):
        att.begin_step(3, 3, ubatch=(0, 3), ubatch_tokens=[1, 1, 1])
    att.end_step()  # nothing to close


def test_the_planes_members_are_the_connectors(monkeypatch):
    rj.fake_device(monkeypatch.setattr)
    att, ffn = rj.connected(rejoin_on=True)
    assert att.table is att.plane.table and att.flags is att.plane.flags
    stream = object()
    att._slot_stream = lambda: (0, stream)  # written through to the plane
    assert att.plane._slot_stream() == (0, stream)
    assert ffn.inboxes is ffn.plane.inboxes and ffn.slot_bytes == ffn.plane.slot_bytes
    assert not hasattr(type(att.plane), "_dead")  # the channel's state stays the channel's


def test_rejoin_hooks_keep_cuda_ipcs_semantics(monkeypatch):
    """cuda_ipc checks only the forwards whose losses are held (nixl's device path checks
    every one); without ipc_rejoin it cannot rejoin at all."""
    off, on = rj._attention(rejoin_on=False), rj._attention(rejoin_on=True)
    assert not off.reruns_forward and not off.plane.rejoins and not off.can_rejoin
    assert on.reruns_forward and on.plane.rejoins and not on.checks_every_forward
    on.forwards_guarded = True
    assert on.can_rejoin and on.holds_losses()
    # a loss the watchdog finds ends the process unless the role sets its own callback
    assert off.on_failure is failure.exit_now and on.plane.device_session


def test_ffn_generation_announcements_and_release_are_the_planes(monkeypatch):
    rj.fake_device(monkeypatch.setattr)
    _, ffn = rj.connected()
    assert ffn.generation == ffn.plane.generation == 1
    assert ffn.ubatch_controls_upfront and not ffn.async_io and ffn.plane.polls_steps
    a, b = socket.socketpair()
    with a, b:
        peer = Peer(0, a, "attention rank 0")
        ffn.peers = {0: peer}
        ffn._lose(peer, "gone")  # the channel asks the plane to release its waits
    box = ffn.inboxes[0]
    assert box.ctrl[0, ipc.C_DATA : ipc.C_DATA + ipc.SLOTS].eq(ipc.POISON).all()
    assert ffn.lost == {0: "gone"} and ffn.peers == {}
