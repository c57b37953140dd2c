"""nccl connector (vllm.distributed.afd.nccl) without NCCL: the control channel over real
sockets on 127.0.0.1, the PyNccl communicator replaced by a recording fake that pairs
the two members of a unique id in this process (``nccl.make_comm``).

What is checked: the NCCL unique id travels from the FFN rank to the attention rank over
the session's own (handshaken) connection, one communicator per attention-FFN session,
several FFN ranks, the step's control message and each layer's activations by the
communicator with no stream given (PyNccl then uses the current one: capturable), a
restarted attention rank and a restarted FFN rank each met with a new communicator (the
old one aborted), and no rejoin once a CUDA graph holds the communicator. The device
path needs two GPUs (docs/gpu-tests.md) and has not run."""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch
from tcp_lib import HIDDEN, HOST, MAX_TOKENS, Bg, fingerprint, wait_until

from serve_util import free_port
from vllm.afd.connector_spec import SPECS
from vllm.afd.protocol import MSG_STEP, AFDPeerError
from vllm.config.afd import AFDConfig
from vllm.distributed.afd import nccl
from vllm.distributed.afd.base import ConnectorContext, connector_classes
from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId


def _ctx(role: str, port: int, rank: int = 0, m: int = 2, n: int = 1, **keys) -> ConnectorContext:
    cfg = AFDConfig.from_dict({
        "role": role, "connector": "nccl", "host": HOST, "port": port,
        "num_attention_ranks": m, "num_ffn_ranks": n, "timeout_s": 3.0, **keys,
    })  # fmt: skip
    fp = fingerprint(num_attention_ranks=m, num_ffn_ranks=n, connector="nccl")
    return ConnectorContext(cfg, rank, fp, MAX_TOKENS, torch.device("cpu"))


class _Received:
    """The handle of a posted receive (``query()``: arrived)."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeComm:
    """A PyNccl communicator of host memory: takes the unique id as PyNccl does
    (``group.broadcast_obj`` from member 0), records every call, and moves tensors to
    the other member of the same unique id, in order (a receive posted before the send
    is filled by it)."""

    wires: dict = {}  # unique id -> member -> queued tensors / posted receives

    def __init__(self, group, device):
        self.member, self.device = group.rank, device
        uid = ncclUniqueId()
        if self.member == 0:
            for i, b in enumerate(os.urandom(len(uid.internal))):
                uid.internal[i] = b
        self.uid = bytes(group.broadcast_obj(uid, src=0).internal)
        self.disabled = False
        self.destroyed = False
        self.calls: list[tuple] = []
        FakeComm.made.append(self)

    def _box(self, member: int) -> dict:
        wire = FakeComm.wires.setdefault(self.uid, {})
        return wire.setdefault(member, {"queued": collections.deque(),
                                        "posted": collections.deque()})  # fmt: skip

    def send(self, t: torch.Tensor, dst: int, stream=None) -> None:
        self.calls.append(("send", dst, stream, t.clone()))
        box = self._box(dst)
        if box["posted"]:
            out, handle = box["posted"].popleft()
            out.copy_(t)
            handle.done = True
        else:
            box["queued"].append(t.clone())

    def recv(self, t: torch.Tensor, src: int, stream=None) -> _Received:
        self.calls.append(("recv", src, stream, t.shape))
        box, handle = self._box(self.member), _Received()
        if box["queued"]:
            t.copy_(box["queued"].popleft())
            handle.done = True
        else:
            box["posted"].append((t, handle))
        return handle

    def destroy(self) -> None:
        self.destroyed = True


@pytest.fixture
def fake(monkeypatch):
    FakeComm.made, FakeComm.wires = [], {}
    monkeypatch.setattr(nccl, "make_comm", FakeComm)
    made: list = []
    yield made
    for c in reversed(made):
        c.close()


def _ffn(made, port: int, rank: int = 0, m: int = 2, n: int = 1):
    ffn = nccl.NCCLFFNConnector(_ctx("ffn", port, rank, m, n))
    made.append(ffn)
    ffn.start()
    return ffn


def _attention(made, port: int, rank: int, m: int = 2, n: int = 1, **keys):
    att = nccl.NCCLAttentionConnector(_ctx("attention", port, rank, m, n, **keys))
    made.append(att)
    return att


def _connect(*atts) -> None:
    for job in [Bg(a.connect) for a in atts]:
        job.get()


def _comm_of(ffn, rank: int):
    return ffn.plane.sessions[rank].comm


def _step(ffn, att, rank: int, n_tokens: int, step_no: int) -> None:
    """One step of ``att`` served by ``ffn``: control, one layer there and back."""
    x = torch.arange(n_tokens * HIDDEN, dtype=torch.float32).view(n_tokens, HIDDEN) + rank
    att.begin_step(step_no, n_tokens)
    att.send(x)
    got: list = []
    wait_until(lambda: bool(got.extend(ffn.wait_step(0.05)) or got), what=f"rank {rank}'s step")
    assert [(s.rank, s.control.type, s.control.num_tokens) for s in got] == [
        (rank, MSG_STEP, n_tokens)
    ]
    inp = torch.empty_like(x)
    ffn.recv(got[0], inp)
    assert torch.equal(inp, x)
    ffn.send(got[0], inp * 2)
    out = att.recv(torch.empty_like(x))
    att.end_step()
    assert torch.equal(out, x * 2)


def test_one_communicator_per_session_from_a_unique_id_sent_over_the_link(fake):
    """Two FFN ranks serving two attention ranks each: every attention-FFN session has a
    communicator of its own, of two members (FFN 0, attention 1), whose unique id the
    FFN rank made and sent over that session's connection."""
    port = free_port()
    ffns = [_ffn(fake, port, f, m=4, n=2) for f in (0, 1)]
    atts = [_attention(fake, port, r, m=4, n=2) for r in range(4)]
    _connect(*atts)
    wait_until(lambda: set(ffns[0].peers) == {0, 1} and set(ffns[1].peers) == {2, 3},
               what="every session accepted")  # fmt: skip
    uids = set()
    for r, att in enumerate(atts):
        mine, theirs = att.plane.comm, _comm_of(ffns[r // 2], r)
        assert (mine.member, theirs.member) == (nccl.ATTENTION_MEMBER, nccl.FFN_MEMBER)
        assert mine.uid == theirs.uid and any(mine.uid)
        uids.add(mine.uid)
        assert att.ffn_rank == r // 2
    assert len(uids) == 4 and len(FakeComm.made) == 8  # no communicator shared
    assert [f.generation for f in ffns] == [2, 2]
    for r, att in enumerate(atts):
        _step(ffns[r // 2], att, r, 3 + r, step_no=1)


def test_control_and_layers_move_by_the_communicator_on_the_current_stream(fake):
    """The step's control message ([tokens, flags]) and the activations are sent and
    received by the session's communicator, with no stream given (PyNccl takes the
    current one: what a CUDA graph captures); nothing of them on the channel."""
    port = free_port()
    ffn = _ffn(fake, port)
    att0, att1 = _attention(fake, port, 0), _attention(fake, port, 1)
    _connect(att0, att1)
    wait_until(lambda: set(ffn.peers) == {0, 1}, what="both ranks accepted")
    assert ffn.wait_step(0.05) == []  # control receives posted, nothing arrived
    _step(ffn, att0, 0, 5, step_no=1)  # rank 1 stays silent: it holds nothing of rank 0
    _step(ffn, att0, 0, 2, step_no=2)
    sent = att0.plane.comm.calls
    assert [(c[0], c[1], c[2]) for c in sent] == [
        ("send", 0, None), ("send", 0, None), ("recv", 0, None),
    ] * 2  # fmt: skip
    assert sent[0][3].tolist() == [5, 0] and sent[3][3].tolist() == [2, 0]  # control
    ffn_calls = _comm_of(ffn, 0).calls
    data = [c for c in ffn_calls if c[3] != (nccl.CONTROL_WORDS,) and c[3] != torch.Size([2])]
    assert [(c[0], c[1], c[2]) for c in data] == [("recv", 1, None), ("send", 1, None)] * 2
    assert att0.is_up() and att1.is_up() and set(ffn.peers) == {0, 1}


def test_a_restarted_attention_rank_gets_a_new_communicator(fake):
    """Before, an nccl FFN rank formed one group for good and refused a rank that
    joined again. Now the rank's session ends with its communicator aborted, the
    restarted rank re-handshakes and a new communicator serves it; the other rank's
    is untouched."""
    port = free_port()
    ffn = _ffn(fake, port)
    att0, att1 = _attention(fake, port, 0), _attention(fake, port, 1)
    _connect(att0, att1)
    wait_until(lambda: set(ffn.peers) == {0, 1}, what="both ranks accepted")
    old, other = _comm_of(ffn, 1), _comm_of(ffn, 0)
    gen = ffn.generation
    att1.close()  # goodbye: its server stopped
    wait_until(lambda: ffn.wait_step(0.01) == [] and 1 not in ffn.peers,
               what="the FFN rank dropped attention rank 1")  # fmt: skip
    wait_until(lambda: old.destroyed, what="the old communicator aborted")
    again = _attention(fake, port, 1)
    _connect(again)
    wait_until(lambda: 1 in ffn.peers, what="rank 1 accepted again")
    new = _comm_of(ffn, 1)
    assert new is not old and new.uid != old.uid and again.plane.comm.uid == new.uid
    assert ffn.generation == gen + 1 and _comm_of(ffn, 0) is other and not other.destroyed
    _step(ffn, again, 1, 4, step_no=1)
    _step(ffn, att0, 0, 3, step_no=1)


def test_the_attention_rank_rejoins_a_restarted_ffn_rank_with_a_new_communicator(fake):
    port = free_port()
    ffn = _ffn(fake, port, m=1)
    att = _attention(fake, port, 0, m=1)
    _connect(att)
    wait_until(lambda: 0 in ffn.peers, what="rank 0 accepted")
    _step(ffn, att, 0, 3, step_no=1)
    first = att.plane.comm
    assert att.reruns_forward and att.checks_every_forward  # forwards re-run whole
    ended: list = []
    att.on_failure = ended.append
    att.forwards_guarded = True  # as run_forward sets it
    assert att.can_rejoin and att.holds_losses()
    ffn.close()
    wait_until(lambda: not att.is_up(), what="the FFN rank's loss noticed")
    wait_until(lambda: first.destroyed, what="its communicator aborted (its operations end)")
    assert att.step_lost() is not None  # a forward during the loss is not clean
    ffn2 = _ffn(fake, port, m=1)
    att.reconnect(time.monotonic() + 5)
    assert att.is_up() and att.plane.comm is not first and att.plane.sessions == 2
    wait_until(lambda: 0 in ffn2.peers, what="rank 0 accepted by the new FFN rank")
    assert att.plane.comm.uid == _comm_of(ffn2, 0).uid != first.uid
    assert att.step_lost() is None
    _step(ffn2, att, 0, 4, step_no=2)
    assert ended == []  # held, not ended


def test_no_rejoin_once_a_cuda_graph_holds_the_communicator(fake, monkeypatch):
    """A captured graph replays the communicator it was captured with: after a capture
    a loss is not held for a rejoin (the engine ends, naming it)."""
    port = free_port()
    ffn = _ffn(fake, port, m=1)
    att = _attention(fake, port, 0, m=1, rejoin_timeout_s=30)
    _connect(att)
    wait_until(lambda: 0 in ffn.peers, what="rank 0 accepted")
    att.forwards_guarded = True
    assert att.can_rejoin and att.holds_losses()
    monkeypatch.setattr(nccl, "_capturing", lambda t: True)  # a capture in progress
    att.begin_step(1, 2)
    att.send(torch.zeros((2, HIDDEN)))
    assert att.plane.captured and not att.can_rejoin and not att.holds_losses()
    ended: list = []
    att.on_failure = ended.append
    ffn.close()
    wait_until(lambda: bool(ended), what="the loss ends the rank")
    assert "lost AFD" in ended[0] or "FFN rank" in ended[0], ended


def test_the_spec_record_declares_graphs_rejoin_and_any_number_of_ffn_ranks():
    spec = SPECS["nccl"]
    assert spec.graph_capable and spec.ffn_graph_capable and not spec.dbo_capable
    assert spec.rejoin == "yes" and spec.max_ffn_ranks is None
    attention, ffn = connector_classes("nccl")
    assert attention.graph_capable and ffn.graph_capable
    assert attention is nccl.NCCLAttentionConnector and ffn is nccl.NCCLFFNConnector
    for n in (2, 4):  # before: "connector 'nccl' serves num_ffn_ranks <= 1"
        cfg = AFDConfig.from_dict({"role": "ffn", "connector": "nccl", "port": 20000,
                                   "num_attention_ranks": 4, "num_ffn_ranks": n})  # fmt: skip
        assert cfg.num_ffn_ranks == n


def test_a_bad_unique_id_is_refused_naming_it(fake):
    """The attention side reads the id from its peer: anything but the id's bytes is
    refused by name, before NCCL sees it."""
    import socket

    from vllm.distributed.afd.channel import send_hello
    from vllm.distributed.afd.plane import Link

    here, there = socket.socketpair()
    with here, there:
        send_hello(there, {nccl.UNIQUE_ID_KEY: "abcd"}, 2.0, "attention")
        group = nccl.LinkGroup(1, Link(here, "FFN rank 0", 2.0, 0, 0), time.monotonic() + 2)
        with pytest.raises(Exception, match="sent no NCCL unique id of 128 bytes"):
            group.broadcast_obj(ncclUniqueId(), src=0)


def test_a_step_of_a_lost_session_fails_by_name(fake):
    port = free_port()
    ffn = _ffn(fake, port, m=1)
    with pytest.raises(AFDPeerError, match="no NCCL session"):
        ffn.plane.recv(nccl.Link(None, "attention rank 0", 1.0, 0, 0), torch.zeros(1))


def test_a_killed_rank_s_communicator_is_aborted_while_the_serve_thread_waits(fake):
    """The FFN host may wait on the device for a pass (a receive from a rank that died
    holds it) and then reads no connection: the watch thread aborts the communicator of
    a session whose peer closed or reset its connection - with a heartbeat of it still
    unread - and no other."""
    from tcp_lib import kill

    port = free_port()
    ffn = _ffn(fake, port)
    att0, att1 = _attention(fake, port, 0), _attention(fake, port, 1)
    att1._heartbeat_loop = lambda: None
    _connect(att0, att1)
    wait_until(lambda: set(ffn.peers) == {0, 1}, what="both ranks accepted")
    dead, alive = _comm_of(ffn, 1), _comm_of(ffn, 0)
    from vllm.afd.protocol import MSG_HEARTBEAT, Control

    att1.sock.sendall(Control(MSG_HEARTBEAT).pack())  # unread: nobody pumps meanwhile
    kill(att1.sock, rst=False)
    t0 = time.monotonic()
    wait_until(lambda: dead.destroyed, timeout=2.0, what="the dead rank's communicator aborted")
    assert time.monotonic() - t0 < 1.0 and not alive.destroyed
    assert set(ffn.peers) == {0, 1}  # (the channel drops it at its next read)

