"""cuda_ipc: what a peer's buffer description can make this side do, and which
buffers each attention rank gets. No GPU: torch's CUDA IPC
mapping (rebuild_cuda_tensor) and the driver's range query are replaced by fakes
that record what reaches them; the FFN rank's buffers are CPU tensors. The device
path runs in tests/gpu/test_gpu_ipc_connector.py."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import types

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from vllm.afd.protocol import (
    MSG_HEARTBEAT,
    MSG_PROFILE,
    MSG_STEP,
    AFDProtocolError,
    Control,
    pack_hello,
)
from vllm.config.afd import AFDConfig
from vllm.distributed.afd import cuda_ipc as ipc
from vllm.distributed.afd.base import ConnectorContext
from vllm.distributed.afd.channel import Peer, recv_hello

NBYTES = 4096
HANDLE = bytes([2, ord("c")]) + bytes(range(64))  # torch's format: version, 'c', 64 bytes


def _desc(**changes) -> dict:
    """A well-formed description of a NBYTES buffer, as export_buffer makes it."""
    d = {"numel": NBYTES, "offset": 0, "device": 0, "handle": HANDLE.hex(),
         "storage_bytes": NBYTES, "storage_offset": 0}  # fmt: skip
    d.update(changes)
    return d


@pytest.fixture
def mapping(monkeypatch):
    """torch's mapping replaced by a recorder (one visible CUDA device); the peer's
    segment is as large as asked unless a test says otherwise."""
    calls: list[tuple] = []
    seg = {"size": None, "offset": 0}

    def rebuild(*args):
        calls.append(args)
        return torch.zeros(args[1][0], dtype=torch.uint8)

    def mapped_range(ptr):
        return ptr - seg["offset"], seg["size"] or NBYTES

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(ipc, "mapped_range", mapped_range)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return calls, seg


# ------------------------------------------------------ the peer's description
def test_the_peers_ref_counter_and_event_never_reach_torch(mapping):
    """torch's deleter decrements the int64 at (ref_counter_handle, ref_counter_offset)
    when the mapping is dropped: a forged pair made this process decrement any int64 of
    a shared-memory file of its user."""
    calls, _ = mapping
    forged = _desc(ref_handle=b"/torch_123_victim".hex(), ref_offset=4242,
                   event_handle=("ab" * 64), event_sync=True)  # fmt: skip
    t = ipc.import_buffer(forged, NBYTES, "inbox")
    assert t.numel() == NBYTES and len(calls) == 1
    (
        _cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes,
        storage_offset, requires_grad, ref_handle, ref_offset, event_handle, event_sync,
    ) = calls[0]  # fmt: skip
    assert (tuple(size), stride, offset, dtype, device) == ((NBYTES,), (1,), 0, torch.uint8, 0)
    assert (handle, storage_bytes, storage_offset, requires_grad) == (HANDLE, NBYTES, 0, False)
    assert (ref_handle, ref_offset) == (ipc.NO_REF_COUNTER, 0)
    assert (event_handle, event_sync) == (b"", False)
    assert 4242 not in calls[0] and b"/torch_123_victim" not in calls[0]


def test_the_stand_in_ref_counter_name_can_never_be_opened():
    """The name the importer passes instead makes torch's deleter skip the decrement:
    shm_open refuses it (EINVAL), and so nobody can create it either."""
    import _posixshmem
    import errno

    name = ipc.NO_REF_COUNTER.decode()
    for flags in (os.O_RDWR, os.O_RDWR | os.O_CREAT | os.O_EXCL):
        with pytest.raises(OSError) as e:
            _posixshmem.shm_open(name, flags, 0o600)
        assert e.value.errno == errno.EINVAL


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"storage_bytes": NBYTES * 2}, "'storage_bytes' is 8192, this side needs 4096"),
        ({"storage_bytes": NBYTES - 1}, "'storage_bytes' is 4095"),
        ({"numel": NBYTES + 1}, "'numel' is 4097, this side needs 4096"),
        ({"offset": 256}, "'offset' is 256, this side needs 0"),
        ({"storage_offset": 1 << 40}, "'storage_offset' is 1099511627776, this side needs 0"),
        ({"storage_offset": -512}, "'storage_offset' is -512, expected a non-negative integer"),
        ({"numel": True}, "'numel' is True"),
        ({"offset": "0"}, "'offset' is '0'"),
        ({"storage_bytes": 10**400}, "'storage_bytes' is 1000000000"),
        ({"device": 1}, "'device' is 1, this process sees 1 CUDA device"),
        ({"device": None}, "'device' is None"),
        ({"handle": HANDLE[:-1].hex()}, "'handle' is not a 66-byte CUDA IPC handle"),
        ({"handle": (HANDLE + b"\0").hex()}, "'handle' is not a 66-byte"),
        ({"handle": "zz" * 66}, "'handle' is not a 66-byte"),
        ({"handle": 7}, "'handle' is not a 66-byte"),
        ({"handle": (bytes([2, ord("e")]) + bytes(64)).hex()},
         "expandable segment: set PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True"),
    ],
)  # fmt: skip
def test_a_bad_field_is_refused_before_anything_is_mapped(mapping, changes, field):
    calls, _ = mapping
    with pytest.raises(AFDProtocolError) as e:
        ipc.import_buffer(_desc(**changes), NBYTES, "outbox")
    assert str(e.value).startswith("bad CUDA IPC description of the peer's outbox: ")
    assert field in str(e.value)
    assert calls == []


def test_a_missing_field_is_named(mapping):
    d = _desc()
    del d["storage_offset"]
    with pytest.raises(AFDProtocolError, match="'storage_offset' is None"):
        ipc.import_buffer(d, NBYTES, "inbox")
    with pytest.raises(AFDProtocolError, match="not an object"):
        ipc.check_buffer_desc([], NBYTES, "inbox", 1)


@pytest.mark.parametrize("size, offset", [(NBYTES - 512, 0), (2 << 20, 512)])
def test_a_segment_smaller_than_described_is_refused_after_mapping(mapping, size, offset):
    """Whether the peer's segment really holds the bytes described shows only once
    it is mapped (the driver's range of the mapping): before any device access."""
    calls, seg = mapping
    seg.update(size=size, offset=offset)
    with pytest.raises(
        AFDProtocolError,
        match=f"the peer's inbox maps {size} bytes at "
        f"offset {offset} of its segment, this side needs 4096 from its start",
    ):
        ipc.import_buffer(_desc(), NBYTES, "inbox")  # fmt: skip
    assert len(calls) == 1


# --------------------------------------------------- per-rank buffers (FFN side)
def _ffn(m: int = 3) -> ipc.IPCFFNConnector:
    cfg = AFDConfig.from_dict({"role": "ffn", "connector": "cuda_ipc", "port": 1,
                               "num_attention_ranks": m, "timeout_s": 2.0})  # fmt: skip
    fp = {"hidden_size": 16, "dtype": "bfloat16"}
    return ipc.IPCFFNConnector(ConnectorContext(cfg, 0, fp, 8, torch.device("cpu")))


@pytest.fixture
def cpu_buffers(monkeypatch, mapping):
    """The FFN rank's exported buffers as CPU tensors, described by their address;
    device synchronisation and streams are no-ops."""
    exported: dict[int, torch.Tensor] = {}

    def zeros(nbytes, device):
        t = torch.zeros(nbytes, dtype=torch.uint8)
        exported[t.data_ptr()] = t
        return t

    monkeypatch.setattr(ipc, "exported_zeros", zeros)
    monkeypatch.setattr(ipc, "export_buffer", lambda t: {"ptr": t.data_ptr(), "numel": t.numel()})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return exported


def _join(conn: ipc.IPCFFNConnector, rank: int, flags: dict | None = None) -> dict:
    """Drive the FFN side of rank ``rank``'s buffer exchange over a socket pair; the
    FFN's answer."""
    here, there = socket.socketpair()
    with here, there:
        attention = {
            "flags": _desc(numel=ipc.FLAGS_BYTES, storage_bytes=ipc.FLAGS_BYTES),
            "outbox": _desc(numel=2 * conn.slot_bytes, storage_bytes=2 * conn.slot_bytes),
        }
        attention.update(flags or {})
        here.sendall(pack_hello(ipc._flat(attention)))
        try:
            conn._accept_device(rank, there, f"addr-{rank}")
        except AFDProtocolError:
            pass  # answered first: the reply says why
        return recv_hello(here, time.monotonic() + 5, "FFN rank")


def test_each_attention_rank_gets_only_its_own_buffers(cpu_buffers):
    conn = _ffn(m=3)
    conn._make_buffers(torch.device("cpu"))
    mine = {r: {conn.inboxes[r].ctrl.data_ptr(), conn.inboxes[r].data.data_ptr()}
            for r in (0, 1, 2)}  # fmt: skip
    assert len(set().union(*mine.values())) == 6  # six buffers, each exported on its own
    assert set().union(*mine.values()) == set(cpu_buffers)
    for r in (0, 1, 2):
        box = conn.inboxes[r]
        assert box.ctrl.shape == (ipc.CTRL_ROWS, ipc.ROW) and box.ctrl.dtype == torch.int64
        assert box.data.numel() == ipc.SLOTS * conn.slot_bytes
        box.ctrl.fill_(9)  # a previous session's state, its error word included
        reply = _join(conn, r)
        assert reply["status"] == "ok"
        assert set(reply) == {"status", "gpu_uuid", "ctrl.ptr", "ctrl.numel", "inbox.ptr",
                              "inbox.numel"}
        given = {reply["ctrl.ptr"], reply["inbox.ptr"]}
        assert given == mine[r] and reply["ctrl.numel"] == ipc.CTRL_BYTES
        assert not given & set().union(*(mine[o] for o in (0, 1, 2) if o != r))
        assert box.ctrl.eq(0).all() and box.seen == 0  # the new session starts clean
    assert conn.generation == 3


def test_a_bad_description_of_the_attention_rank_is_answered_naming_the_field(cpu_buffers):
    conn = _ffn(m=1)
    conn._make_buffers(torch.device("cpu"))
    forged = {"outbox": _desc(numel=2 * conn.slot_bytes, storage_bytes=1 << 30)}
    reply = _join(conn, 0, forged)
    assert reply["status"].startswith(
        "cannot map buffers: bad CUDA IPC description of the peer's outbox: 'storage_bytes' "
        f"is {1 << 30}, this side needs {2 * conn.slot_bytes}"
    )
    assert conn.inboxes[0].outbox is None and conn.generation == 0


def test_a_ranks_error_word_ends_only_its_own_session(cpu_buffers):
    """Rank 0 writes its error word (or the FFN's wait for its data gave up): rank 0's
    session ends - its waits released, its socket closed - and rank 1's step is served.
    Before, one error word shared by all ranks ended the FFN rank."""
    conn = _ffn(m=2)
    conn._make_buffers(torch.device("cpu"))
    conn._host = torch.zeros((2, ipc.CTRL_ROWS, ipc.ROW), dtype=torch.int64)
    conn._side = types.SimpleNamespace(synchronize=lambda: None)
    pairs = [socket.socketpair() for _ in range(2)]
    peers = [Peer(r, pairs[r][0], f"127.0.0.1:{4000 + r}") for r in (0, 1)]
    conn.peers = {p.rank: p for p in peers}
    try:
        conn.inboxes[0].ctrl[ipc.ERR_ROW, 0] = 3
        row = conn.inboxes[1].ctrl[0]
        row[ipc.C_FLAG] = row[ipc.C_SEQ] = 1
        row[ipc.C_TOKENS] = 5
        ready = conn._device_ready(peers)
        assert [(s.rank, s.control.type, s.control.num_tokens) for s in ready] == [(1, MSG_STEP, 5)]
        assert set(conn.peers) == {1}
        data_flags = conn.inboxes[0].ctrl[0, ipc.C_DATA : ipc.C_DATA + ipc.SLOTS]
        assert data_flags.eq(ipc.POISON).all()  # its device waits are released
        assert conn.inboxes[1].ctrl[0, ipc.C_DATA :].ne(ipc.POISON).all()
        pairs[0][1].settimeout(5)
        assert pairs[0][1].recv(1) == b""  # its attention server sees EOF
        assert conn._device_ready([peers[1]]) == []  # nothing new, and no failure
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_a_rank_that_joins_again_gets_fresh_buffers(cpu_buffers):
    """A restarted attention rank handshakes again. It gets new buffers (the
    previous session's process may still map, and write, the old ones) and a clean error
    word; the other rank's buffers stay."""
    conn = _ffn(m=2)
    conn._make_buffers(torch.device("cpu"))
    first, other = _join(conn, 0), _join(conn, 1)
    old = conn.inboxes[0]
    old.ctrl[ipc.ERR_ROW, 0] = 3  # the lost session's error word
    again = _join(conn, 0)
    assert again["status"] == "ok" and conn.generation == 3  # graphs are dropped
    assert {again["ctrl.ptr"], again["inbox.ptr"]}.isdisjoint(
        {first["ctrl.ptr"], first["inbox.ptr"]}
    )
    box = conn.inboxes[0]
    assert box.row == old.row and box.ctrl.eq(0).all() and box is not old
    assert (conn.inboxes[1].ctrl.data_ptr(), conn.inboxes[1].data.data_ptr()) == (
        other["ctrl.ptr"],
        other["inbox.ptr"],
    )
    third = _join(conn, 0)
    assert {third["ctrl.ptr"], third["inbox.ptr"]}.isdisjoint(
        {first["ctrl.ptr"], first["inbox.ptr"], again["ctrl.ptr"], again["inbox.ptr"]}
    )


def test_a_closed_rank_is_dropped_with_its_waits_released_and_the_other_kept(cpu_buffers):
    """EOF of one rank's socket (its server died) ends that rank's session only: no
    error out of the poll (before: the FFN rank ended), its device waits poisoned."""
    conn = _ffn(m=2)
    conn._make_buffers(torch.device("cpu"))
    pairs = [socket.socketpair() for _ in range(2)]
    peers = [Peer(r, pairs[r][0], f"127.0.0.1:{4000 + r}") for r in (0, 1)]
    conn.peers = {p.rank: p for p in peers}
    try:
        pairs[0][1].close()
        conn._check_sockets(peers)
        assert set(conn.peers) == {1} and "connection closed" in conn.lost[0]
        assert conn.inboxes[0].ctrl[0, ipc.C_DATA : ipc.C_DATA + ipc.SLOTS].eq(ipc.POISON).all()
        assert conn.inboxes[1].ctrl[0, ipc.C_DATA :].ne(ipc.POISON).all()
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_a_rank_stopped_mid_control_frame_holds_no_other_rank(cpu_buffers):
    """The FFN host's check of its ranks' control channels (heartbeats, goodbyes, profiler
    requests; steps come by device) reads a frame as its bytes come: a rank stopped
    mid-frame holds neither the check nor the other rank, and is dropped at its own
    deadline (timeout_s after its last byte), its waits released. Before, the check read
    the frame to its end, blocking timeout_s."""
    conn = _ffn(m=2)  # timeout_s 2
    conn._make_buffers(torch.device("cpu"))
    pairs = [socket.socketpair() for _ in range(2)]
    peers = [Peer(r, pairs[r][0], f"127.0.0.1:{4000 + r}") for r in (0, 1)]
    conn.peers = {p.rank: p for p in peers}
    try:
        pairs[1][1].sendall(Control(MSG_HEARTBEAT).pack()[:5])  # then it stops
        last_byte = time.monotonic()
        pairs[0][1].sendall(Control(MSG_PROFILE, flags=1).pack())
        t0 = time.monotonic()
        conn._check_sockets(peers)
        assert time.monotonic() - t0 < 0.5
        assert conn.take_profile_requests() == [True] and set(conn.peers) == {0, 1}
        while 1 in conn.peers:  # rank 0 heartbeats on; rank 1 stays stopped
            assert time.monotonic() - last_byte < 4.0, "rank 1 not dropped"
            pairs[0][1].sendall(Control(MSG_HEARTBEAT).pack())
            conn._check_sockets([p for p in peers if conn.peers.get(p.rank) is p])
            time.sleep(0.05)
        took = time.monotonic() - last_byte
        assert 1.9 <= took <= 2.5, took
        assert "attention rank 1 at 127.0.0.1:4001: nothing received for 2 s" in conn.lost[1]
        assert set(conn.peers) == {0}
        assert conn.inboxes[1].ctrl[0, ipc.C_DATA : ipc.C_DATA + ipc.SLOTS].eq(ipc.POISON).all()
        assert conn.inboxes[0].ctrl[0, ipc.C_DATA :].ne(ipc.POISON).all()
    finally:
        for a, b in pairs:
            a.close()
            b.close()
