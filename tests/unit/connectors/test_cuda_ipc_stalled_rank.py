"""cuda_ipc, FFN side: an attention rank that stops in the middle of a step (SIGSTOP after
its control message, before a layer's data) holds no other rank of the pass. The FFN host
waits for each rank's layer input before it enqueues the receive (a small copy of the
rank's flags), so the stopped rank is dropped at its own deadline (timeout_s) with no
device wait enqueued for it, and the other rank's layers go on at once. Before, each
receive enqueued a device wait of up to timeout_s on its rank's flag, one after another
in the pass: the stopped rank's waits (one per remaining layer) held every other rank.

No GPU: the FFN rank's buffers are CPU tensors and the device wait a recorder (the
fixtures of test_cuda_ipc_isolation); the GPU scenario is
tests/gpu/test_gpu_ipc_stalled_rank.py."""

from __future__ import annotations

import socket
import time
import types

import pytest
import test_cuda_ipc_isolation as iso
import torch

from vllm.afd.protocol import MSG_HEARTBEAT, MSG_STEP, AFDPeerError, Control
from vllm.distributed.afd import cuda_ipc as ipc
from vllm.distributed.afd import ipc_kernels as kernels
from vllm.distributed.afd.base import StepPeer
from vllm.distributed.afd.channel import Peer

mapping, cpu_buffers = iso.mapping, iso.cpu_buffers  # the fixtures


@pytest.fixture
def waits(monkeypatch):
    """The device waits enqueued: the address of the flag each one spins on."""
    enqueued: list[int] = []
    monkeypatch.setattr(kernels, "wait", lambda ctr, flag, err, t: enqueued.append(flag.data_ptr()))
    return enqueued


def _ffn_on_cpu(m: int):
    """An FFN connector of ``m`` attention ranks (timeout_s 2) on CPU buffers, every rank
    joined."""
    conn = iso._ffn(m=m)
    conn._make_buffers(torch.device("cpu"))
    conn._host = torch.zeros((m, ipc.CTRL_ROWS, ipc.ROW), dtype=torch.int64)
    conn._side = types.SimpleNamespace(synchronize=lambda: None)
    for r in range(m):
        assert iso._join(conn, r)["status"] == "ok"
    return conn


def test_a_rank_stopped_mid_step_is_dropped_at_its_deadline_and_the_other_served(
    cpu_buffers, waits
):
    conn = _ffn_on_cpu(2)
    pairs = [socket.socketpair() for _ in range(2)]
    peers = [Peer(r, pairs[r][0], f"127.0.0.1:{4000 + r}") for r in (0, 1)]
    conn.peers = {p.rank: p for p in peers}
    boxes = [conn.inboxes[r] for r in (0, 1)]
    flag = [b.ctrl[0, ipc.C_DATA :] for b in boxes]  # each rank's data flag of slot 0
    steps = [StepPeer(r, Control(MSG_STEP, 1, 3, 0), peers[r]) for r in (0, 1)]
    x = torch.empty((3, 16), dtype=torch.bfloat16)
    try:
        # Both ranks opened a step; rank 0 sent its first layer's input, rank 1 stopped.
        flag[0][0] = 1
        t0 = time.monotonic()
        conn.recv(steps[0], x)
        assert time.monotonic() - t0 < 0.5 and waits == [flag[0].data_ptr()]
        pairs[1][1].sendall(Control(MSG_HEARTBEAT).pack())  # its last byte, then it stops
        # Rank 0 now waits for this side's output and sends nothing (no heartbeats in a
        # step). Its last byte is older than the wait on rank 1 begins (here by 0.3 s):
        # it is not taken for silent at its own timeout_s while the FFN waits on rank 1.
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(AFDPeerError, match="attention rank 1 at 127.0.0.1:4001 did not "
                                               "send layer data within timeout_s=2"):  # fmt: skip
            conn.recv(steps[1], x)
        took = time.monotonic() - t0
        assert 1.9 <= took <= 2.6, took
        assert waits == [flag[0].data_ptr()]  # no device wait on the stopped rank's flag
        # The runner drops it (its waits released, its socket closed) ...
        conn.drop_peer(steps[1], "AFD attention rank 1 did not send layer data")
        assert set(conn.peers) == {0}
        assert boxes[1].ctrl[0, ipc.C_DATA : ipc.C_DATA + ipc.SLOTS].eq(ipc.POISON).all()
        pairs[1][1].settimeout(5)
        assert pairs[1][1].recv(64) == b""  # (after the heartbeat's bytes: EOF)
        # ... and rank 0's next layers are received at once, each a wait on its own flag.
        for layer in (2, 3):
            flag[0][0] = layer
            t0 = time.monotonic()
            conn.recv(steps[0], x)
            assert time.monotonic() - t0 < 0.5
        assert waits == [flag[0].data_ptr()] * 3
        assert boxes[0].expect == [3, 0]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_the_hosts_count_follows_the_device_after_a_graph_capture(cpu_buffers, waits):
    """A replayed graph advances the device counters only: after a capture the host reads
    them again before it compares a rank's flag with the message its receive waits for."""
    conn = _ffn_on_cpu(1)
    box = conn.inboxes[0]
    link = ipc.Link(None, "attention rank 0", 2.0, 0, 0)
    box.ctrl[0, ipc.C_DATA] = 1
    assert conn.plane.input_ready(link, 0)
    conn.plane.recv(link, torch.empty((2, 16), dtype=torch.bfloat16), 0)  # message 1 taken
    assert not conn.plane.input_ready(link, 0)  # waits for message 2
    conn.counters[0, 0] = 6  # five replays received messages 2..6 on the device
    conn.plane._expect_stale = True  # (what a receive under capture sets)
    box.ctrl[0, ipc.C_DATA] = 6
    assert not conn.plane.input_ready(link, 0) and box.expect == [6, 0]
    box.ctrl[0, ipc.C_DATA] = 7
    assert conn.plane.input_ready(link, 0)


def test_a_rank_whose_layer_was_answered_is_silent_again_at_its_timeout(
    cpu_buffers, waits, monkeypatch
):
    """A rank counts as waiting for the FFN side from its layer's inputs (the rows and the
    router logits: two receives) to the layer's output; once the output is sent its
    silence counts again, so a rank stopped between steps is still dropped at timeout_s."""
    monkeypatch.setattr(kernels, "signal", lambda ctr, flag: None)
    conn = _ffn_on_cpu(1)
    a, b = socket.socketpair()
    peer = Peer(0, a, "127.0.0.1:4000")
    conn.peers = {0: peer}
    flag = conn.inboxes[0].ctrl[0, ipc.C_DATA :]
    step = StepPeer(0, Control(MSG_STEP, 1, 3, 0), peer)
    try:
        for msg in (1, 2):  # the layer's rows, then its router logits
            flag[0] = msg
            conn.recv(step, torch.empty((3, 16), dtype=torch.bfloat16))
        conn.send(step, torch.zeros((3, 16), dtype=torch.bfloat16))
        t0 = time.monotonic()
        while 0 in conn.peers and time.monotonic() - t0 < 5:
            conn.pump(0.05)
        took = time.monotonic() - t0
        assert 0 not in conn.peers and 1.9 <= took <= 2.6, took
        assert (
            conn.lost[0] == "lost AFD attention rank 0 at 127.0.0.1:4000: nothing received for 2 s"
        )
    finally:
        a.close()
        b.close()
