"""cuda_ipc rejoin of a restarted FFN rank (connector_extra_config.ipc_rejoin,
opt-in; docs/connectors.md), the parts that need no GPU: the opt-in and its
default, the kernels each path launches, the pointer table and the attention
rank's own buffers across a re-handshake with a new FFN rank (the table's
kernels run for real in Triton's interpreter, in a child process), the
watchdog's choice between holding a loss and ending the rank, and
``run_forward``'s decision to re-run a forward, and the model runners' hook
(``vllm.afd.attention.guard_forward``) routing a forward there. The device path
runs in tests/gpu/test_gpu_ipc_connector.py (test_ipc_rejoin_*), the `vllm
serve` restart in tests/gpu/test_gpu_ipc_restart.py.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from vllm.afd import failure, rejoin
from vllm.afd.protocol import AFDPeerError
from vllm.config.afd import AFDConfig
from vllm.distributed.afd import cuda_ipc as ipc
from vllm.distributed.afd import ipc_kernels as kernels
from vllm.distributed.afd.base import ConnectorContext

HIDDEN = 16
TOKENS = 8


def _ctx(role: str, extra: dict | None = None, **keys) -> ConnectorContext:
    cfg = AFDConfig.from_dict({"role": role, "connector": "cuda_ipc", "port": 1,
                               "timeout_s": 10.0, "connector_extra_config": extra or {},
                               **keys})  # fmt: skip
    fp = {"hidden_size": HIDDEN, "dtype": "bfloat16"}
    return ConnectorContext(cfg, 0, fp, TOKENS, torch.device("cpu"))


def _attention(rejoin_on: bool = True, **keys) -> ipc.IPCAttentionConnector:
    extra = {"ipc_rejoin": True} if rejoin_on else {}
    return ipc.IPCAttentionConnector(_ctx("attention", extra, **keys))


def fake_device(set_attr) -> dict[int, torch.Tensor]:
    """CPU tensors for every exported buffer, described by their address; the
    "mapping" of a description is the exporter's own tensor (both sides live in
    this process), device synchronisation and streams are no-ops. ``set_attr``:
    monkeypatch.setattr, or setattr in the child process."""
    exported: dict[int, torch.Tensor] = {}

    def zeros(nbytes, device):
        t = torch.zeros(nbytes, dtype=torch.uint8)
        exported[t.data_ptr()] = t
        return t

    set_attr(ipc, "exported_zeros", zeros)
    set_attr(ipc, "export_buffer", lambda t: {"ptr": t.data_ptr(), "numel": t.numel()})
    set_attr(ipc, "import_buffer", lambda d, nbytes, what: exported[d["ptr"]])
    set_attr(torch.cuda, "synchronize", lambda device=None: None)
    set_attr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return exported


def new_ffn() -> ipc.IPCFFNConnector:
    """A (re)started FFN rank: buffers of its own, as at start."""
    conn = ipc.IPCFFNConnector(_ctx("ffn"))
    conn._make_buffers(torch.device("cpu"))
    return conn


def handshake(att: ipc.IPCAttentionConnector, ffn: ipc.IPCFFNConnector, again: bool) -> None:
    """The buffer exchange of a (re-)handshake over a socket pair: the FFN rank's
    side in a thread, the attention rank's as at connect (``again``: through
    ``reconnect``, as a rejoin does)."""
    here, there = socket.socketpair()
    with there:
        t = threading.Thread(target=ffn._accept_device, args=(0, there, "attention rank 0"))
        t.start()
        deadline = time.monotonic() + 5
        if again:
            # tcp's dial and hello stand aside; the rest of the rejoin is the real one
            att._establish = lambda d, backoff, rejoining: (att._remap(here, d), (here, None))[1]
            att.reconnect(deadline)
        else:
            with here:
                att._map_peer(here, deadline)
            if att.reruns_forward:
                att.table = torch.zeros(ipc.ROW, dtype=torch.int64)
                att._point_table()
        t.join(5)
        assert not t.is_alive()


def connected(rejoin_on: bool = True) -> tuple[ipc.IPCAttentionConnector, ipc.IPCFFNConnector]:
    att = _attention(rejoin_on)
    att._make_own(torch.device("cpu"))
    att._slot_stream = lambda: (0, None)  # outside DBO: slot 0, the current stream
    att.sock, att.test_far_end = socket.socketpair()  # the TCP side channel
    ffn = new_ffn()
    handshake(att, ffn, again=False)
    return att, ffn


# ------------------------------------------------------------------ the opt-in
def test_ipc_rejoin_is_off_by_default_and_then_ends_the_rank_as_before():
    att = _attention(rejoin_on=False)
    assert att.reruns_forward is False and att.can_rejoin is False
    assert rejoin.possible(att, ubatched=False) is False
    assert not att.holds_losses()
    att.forwards_guarded = True
    assert not att.holds_losses()
    on = _attention()
    assert on.reruns_forward and not on.can_rejoin  # not before a forward ran under run_forward
    on.forwards_guarded = True
    assert on.can_rejoin and rejoin.possible(on, ubatched=False)


def test_ipc_rejoin_must_be_a_boolean():
    with pytest.raises(ValueError, match="connector_extra_config.ipc_rejoin must be true or false"):
        ipc.IPCAttentionConnector(_ctx("attention", {"ipc_rejoin": "yes"}))


def test_a_loss_is_held_only_under_run_forward_and_a_nonzero_window():
    att = _attention()
    assert not att.holds_losses()  # no forward has run under run_forward yet
    att.forwards_guarded = True
    assert att.holds_losses()
    zero = _attention(rejoin_timeout_s=0)
    zero.forwards_guarded = True
    assert not zero.holds_losses()


# -------------------------------------------- what the graphs' kernels address
@pytest.fixture
def launches(monkeypatch):
    """The kernels each path launches, with the address of each tensor argument."""
    calls: list[tuple] = []

    def record(name):
        def launch(*args, **kw):
            calls.append((name, *[a.data_ptr() if isinstance(a, torch.Tensor) else a
                                   for a in args]))  # fmt: skip

        return launch

    for name in ("signal", "control", "wait", "signal_via", "control_via", "copy_via"):
        monkeypatch.setattr(kernels, name, record(name))
    return calls


def test_off_the_kernels_write_the_ffn_ranks_mapped_buffers_directly(monkeypatch, launches):
    fake_device(monkeypatch.setattr)
    att, ffn = connected(rejoin_on=False)
    box = ffn.inboxes[0]
    x = torch.ones((3, HIDDEN), dtype=torch.bfloat16)
    att.begin_step(1, 3)
    att.send(x)
    assert att.table is None
    assert [c[0] for c in launches] == ["control", "signal"]
    assert launches[0][2] == box.ctrl.data_ptr()  # the FFN rank's control row
    assert launches[1][2] == box.ctrl[0, ipc.C_DATA :].data_ptr()
    assert torch.equal(box.data[: x.numel() * 2].view(torch.bfloat16).view(3, HIDDEN), x)


def test_on_the_kernels_reach_the_ffn_rank_only_through_the_table(monkeypatch, launches):
    exported = fake_device(monkeypatch.setattr)
    att, ffn = connected()
    x = torch.ones((3, HIDDEN), dtype=torch.bfloat16)
    att.begin_step(1, 3)
    att.send(x)
    att.send(torch.ones((3, 4), dtype=torch.float32))
    assert [c[0] for c in launches] == ["control_via", "copy_via", "signal_via", "copy_via",
                                        "signal_via"]  # fmt: skip
    box = ffn.inboxes[0]

    def peers(a) -> bool:  # an address inside one of the FFN rank's buffers
        return any(t.data_ptr() <= a < t.data_ptr() + t.numel() * t.element_size()
                   for t in (box.ctrl, box.data))  # fmt: skip

    for call in launches:
        assert call[2] == att.table.data_ptr(), call
        assert not any(isinstance(a, int) and peers(a) for a in call[1:]), call
    assert att.table.tolist()[:2] == [box.ctrl.data_ptr(), box.data.data_ptr()]
    assert box.ctrl.data_ptr() in exported  # (the table holds the mapped buffers)
    # messages at the offsets of the eager path: 256-byte aligned, in order
    assert launches[1][3] == 0 and launches[3][3] == ipc._align(3 * HIDDEN * 2)
    assert launches[2][3] == launches[4][3] == ipc.C_DATA  # the data flag of slot 0


# ------------------------------------- the table and own buffers across a rejoin
def test_a_rehandshake_keeps_the_table_and_own_buffers_and_points_at_the_new_ffn(monkeypatch):
    fake_device(monkeypatch.setattr)
    att, old = connected()
    table, flags, outbox = att.table, att.flags, att.outbox
    assert old.inboxes[0].flags.data_ptr() == flags.data_ptr()
    assert att.table.tolist()[:2] == [old.inboxes[0].ctrl.data_ptr(),
                                      old.inboxes[0].data.data_ptr()]  # fmt: skip
    att.state.fill_(7)  # counters and error word of the lost session
    att._hold("lost AFD peer: connection closed")
    assert att.flags[: ipc.SLOTS].eq(ipc.POISON).all()  # the held step's waits released
    new = new_ffn()
    handshake(att, new, again=True)
    # what the captured graphs hold did not move ...
    assert att.table is table and att.table.data_ptr() == table.data_ptr()
    assert att.flags.data_ptr() == flags.data_ptr() and att.outbox is outbox
    # ... the new FFN rank mapped the same own buffers, the table points at its own
    assert new.inboxes[0].flags.data_ptr() == flags.data_ptr()
    assert new.inboxes[0].outbox.data_ptr() == outbox.data_ptr()
    assert att.table.tolist()[:2] == [new.inboxes[0].ctrl.data_ptr(),
                                      new.inboxes[0].data.data_ptr()]  # fmt: skip
    assert att.table.tolist()[:2] != [old.inboxes[0].ctrl.data_ptr(),
                                      old.inboxes[0].data.data_ptr()]  # fmt: skip
    # the new session starts clean, as the new FFN rank's counters do
    assert att.state.eq(0).all() and att.flags.eq(0).all()
    assert att._dead is None and not att._held and att.is_up()  # watched again


def test_the_table_kernels_follow_a_rehandshake_in_triton_s_interpreter():
    """The kernels of the opt-in path for real (Triton's CPU interpreter, which
    must be chosen before triton compiles them: a child process): a step before
    the loss lands in the first FFN rank's buffers, the same launches after the
    re-handshake in the new one's, and the first one's stay as they were."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests = Path(__file__).resolve().parents[2]
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import overlay_import; "
            "overlay_import.install(); import test_cuda_ipc_rejoin as t; "
            "t.interpreted_scenario()")  # fmt: skip
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-c", code, str(tests), here], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("rejoin scenario: ok")


def interpreted_scenario() -> None:
    fake_device(setattr)
    att, old = connected()
    x = torch.arange(3 * HIDDEN, dtype=torch.float32).view(3, HIDDEN).to(torch.bfloat16)

    def step(ffn: ipc.IPCFFNConnector) -> None:
        att.begin_step(1, 3)
        att.send(x)
        box = ffn.inboxes[0]
        row = box.ctrl[0].tolist()
        assert row[ipc.C_FLAG] == row[ipc.C_SEQ] == 1 and row[ipc.C_TOKENS] == 3, row
        assert row[ipc.C_DATA] == 1, row  # one message in slot 0
        got = box.data[: x.numel() * 2].view(torch.bfloat16).view(3, HIDDEN)
        assert torch.equal(got, x)
        ffn._host = torch.zeros((1, ipc.CTRL_ROWS, ipc.ROW), dtype=torch.int64)
        ffn._side = types.SimpleNamespace(synchronize=lambda: None)
        steps = ffn._device_ready([_StubPeer()])
        assert len(steps) == 1 and steps[0].control.num_tokens == 3  # a step it accepts

    step(old)
    before = (old.inboxes[0].ctrl.clone(), old.inboxes[0].data.clone())
    att._hold("lost AFD peer: connection closed")
    new = new_ffn()
    handshake(att, new, again=True)
    step(new)  # counters restarted on both sides: message 1 of the new session
    assert torch.equal(old.inboxes[0].ctrl, before[0])
    assert torch.equal(old.inboxes[0].data, before[1])
    print("rejoin scenario: ok")


class _StubPeer:
    rank = 0
    name = "attention rank 0"
    last_seen = 0.0


# ------------------------------------------------------ the watchdog's choice
def _watch(att: ipc.IPCAttentionConnector, msg: str, monkeypatch) -> list:
    recorded: list = []
    monkeypatch.setattr(failure, "record", lambda *a: recorded.append(a))
    att._probe = lambda: msg
    att.on_failure = lambda m: recorded.append(("ended", m))
    watch = threading.Thread(target=att._watchdog, daemon=True)
    watch.start()
    deadline = time.monotonic() + 5
    while not (recorded or att._held) and time.monotonic() < deadline:
        time.sleep(0.01)
    att.close()
    watch.join(5)
    return recorded


def test_the_watchdog_holds_a_loss_under_run_forward_and_releases_own_waits(monkeypatch):
    fake_device(monkeypatch.setattr)
    att, _ = connected()
    att.forwards_guarded = True
    recorded = _watch(att, "lost AFD peer x: connection closed", monkeypatch)
    assert recorded == [] and att._held
    assert att._dead == "lost AFD peer x: connection closed" and att.lost_at() is not None
    assert att.flags[: ipc.SLOTS].eq(ipc.POISON).all()


@pytest.mark.parametrize("rejoin_on", [False, True])
def test_the_watchdog_ends_the_rank_as_before_otherwise(monkeypatch, rejoin_on):
    """Off (the default), and on before any forward ran under run_forward (a
    forward outside it - the engine's start-up runs - would have its output
    reach sampling unchecked)."""
    fake_device(monkeypatch.setattr)
    att, _ = connected(rejoin_on)
    recorded = _watch(att, "lost AFD peer x: connection closed", monkeypatch)
    msg = "lost AFD peer x: connection closed"
    assert recorded == [("attention", 0, msg), ("ended", msg)] and not att._held
    assert att.flags.eq(0).all()  # nothing released: the process ends


# ------------------------------------------------ run_forward's decision
class FakeConn:
    """A cuda_ipc attention connector as run_forward sees it: ``losses`` says, for
    each pass, why the FFN rank was lost during it (None: a clean pass)."""

    def __init__(self, losses, window=5.0, rejoin_on=True, reconnect_fails=False,
                 checks_every_forward=False):  # fmt: skip
        self.ctx = _ctx("attention", rejoin_timeout_s=window)
        self.reruns_forward = rejoin_on
        self.checks_every_forward = checks_every_forward  # nixl's device path: True
        self.forwards_guarded = False
        self.losses = list(losses)
        self.reconnects: list[float] = []
        self.reconnect_fails = reconnect_fails
        self.lost = 100.0

    def holds_losses(self):
        return self.reruns_forward and self.forwards_guarded and self.ctx.config.rejoin_window_s > 0

    def step_lost(self):
        return self.losses.pop(0)

    def lost_at(self):
        return self.lost

    def reconnect(self, deadline):
        self.reconnects.append(deadline)
        if self.reconnect_fails:
            raise AFDPeerError("nothing listens at 127.0.0.1:1")


def _forward(outputs: list):
    calls = []

    def forward():
        calls.append(len(calls))
        return outputs[len(calls) - 1]

    return forward, calls


def test_a_clean_pass_is_returned_at_once():
    conn = FakeConn([None])
    forward, calls = _forward(["out"])
    assert rejoin.run_forward(conn, forward) == "out"
    assert calls == [0] and conn.reconnects == [] and conn.forwards_guarded


def test_a_pass_that_lost_the_ffn_rank_reruns_whole_after_the_rejoin(monkeypatch):
    conn = FakeConn(["lost AFD peer x: connection closed", None])
    forward, calls = _forward(["garbage", "clean"])
    assert rejoin.run_forward(conn, forward) == "clean"  # the first output is dropped
    assert calls == [0, 1] and conn.reconnects == [100.0 + 5.0]


def test_a_lost_connection_seen_at_begin_step_reruns_too():
    conn = FakeConn([None])
    outputs = iter([AFDPeerError("lost AFD peer x: connection closed"), "clean"])

    def forward():
        out = next(outputs)
        if isinstance(out, Exception):
            raise out
        return out

    assert rejoin.run_forward(conn, forward) == "clean" and len(conn.reconnects) == 1


def test_the_rerun_is_bounded_by_the_window_of_the_first_loss(monkeypatch):
    recorded = []
    monkeypatch.setattr(failure, "record", lambda *a: recorded.append(a))
    conn = FakeConn(["lost first"] + ["lost again"] * 3, window=5.0)
    conn.lost = time.monotonic() - 10.0  # the window has passed by the second loss
    forward, calls = _forward(["g1", "g2", "g3", "g4"])
    with pytest.raises(AFDPeerError, match="lost first; lost again while re-running") as e:
        rejoin.run_forward(conn, forward)
    assert calls == [0, 1] and len(conn.reconnects) == 1
    assert recorded == [("attention", 0, str(e.value))]


def test_an_ffn_rank_that_does_not_come_back_fails_the_step_naming_the_loss(monkeypatch):
    recorded = []
    monkeypatch.setattr(failure, "record", lambda *a: recorded.append(a))
    conn = FakeConn(["lost AFD peer x: connection closed"], reconnect_fails=True)
    forward, calls = _forward(["g1"])
    with pytest.raises(AFDPeerError, match="did not come back within rejoin_timeout_s=5"):
        rejoin.run_forward(conn, forward)
    assert calls == [0] and recorded


@pytest.mark.parametrize("conn", [None, FakeConn([], rejoin_on=False), FakeConn([], window=0)])
def test_without_the_opt_in_or_a_window_the_forward_runs_once_unchecked(conn):
    forward, calls = _forward(["out"])
    assert rejoin.run_forward(conn, forward) == "out" and calls == [0]


def test_a_connector_that_checks_every_forward_ends_a_lost_pass_by_name_without_a_window():
    """nixl's device path (checks_every_forward) with rejoin_timeout_s 0: each forward is
    waited for and checked; a clean one is returned, one that lost its FFN rank raises the
    loss by name instead of reaching sampling with what its released waits left."""
    conn = FakeConn([None, "AFD peer FFN rank 0 did not answer within the timeout (nixl)"],
                    window=0, checks_every_forward=True)  # fmt: skip
    forward, calls = _forward(["clean", "garbage"])
    assert rejoin.run_forward(conn, forward) == "clean" and calls == [0]
    with pytest.raises(AFDPeerError, match="did not answer within the timeout"):
        rejoin.run_forward(conn, forward)
    assert calls == [0, 1] and conn.reconnects == []


def test_a_graph_capture_runs_the_forward_once_unchecked(monkeypatch):
    """The hook may also see the model runner's captures: no synchronisation
    there (it would break the capture), and a capture guards nothing yet."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    conn = FakeConn([])  # step_lost would fail: no pass result to give
    forward, calls = _forward(["captured"])
    assert rejoin.run_forward(conn, forward) == "captured" and calls == [0]
    assert not conn.forwards_guarded


# ------------------------------------------- the model runners' hook (guard)
def _recording(outputs: list):
    """A model runner's forward callable: records its arguments, gives ``outputs`` in turn."""
    calls: list = []

    def forward(*args, **kwargs):
        calls.append((args, kwargs))
        return outputs[len(calls) - 1]

    return forward, calls


@pytest.mark.parametrize("conn", [None, FakeConn([], rejoin_on=False)], ids=["no-afd", "no-opt-in"])
def test_the_hook_is_the_forward_itself_without_an_ipc_rejoin_connector(conn, monkeypatch):
    """No AFD connector (an FFN server, plain vLLM past the hook's check), or a
    connector without ipc_rejoin (gloo, nccl, cuda_ipc by default): the runner
    calls its own callable, nothing wrapped."""
    from vllm.afd import attention

    monkeypatch.setattr(attention.CLIENT, "connector", conn)
    forward, calls = _recording(["out"])
    for ubatched in (False, True):
        assert attention.guard_forward(forward, ubatched) is forward
    assert calls == []


def test_the_hook_runs_an_ipc_rejoin_forward_under_run_forward(monkeypatch):
    """The attention rank's connector with ipc_rejoin: a call of the guarded
    callable passes the runner's arguments on, and a pass that lost the FFN rank
    runs again after the rejoin (run_forward); the first output is dropped."""
    from vllm.afd import attention

    conn = FakeConn(["lost AFD peer x: connection closed", None])
    monkeypatch.setattr(attention.CLIENT, "connector", conn)
    forward, calls = _recording(["garbage", "clean"])
    guarded = attention.guard_forward(forward)
    assert guarded is not forward
    assert guarded("batch", n=3) == "clean"
    assert calls == [(("batch",), {"n": 3})] * 2 and len(conn.reconnects) == 1
    assert conn.forwards_guarded


def test_a_micro_batched_forward_rejoins_first_then_runs_once_unguarded(monkeypatch):
    """DBO keeps the fail-fast path: a loss held since the last forward is rejoined
    before the step (a pass of nothing), the step runs once with losses not held
    (the watchdog would end the rank), and guarding is back on after it."""
    from vllm.afd import attention

    # pre-check: lost, then clean after the rejoin; after the DBO forward: clean
    conn = FakeConn(["lost AFD peer x: connection closed", None, None])
    monkeypatch.setattr(attention.CLIENT, "connector", conn)
    seen: list[bool] = []

    def forward(x):
        seen.append(conn.holds_losses())
        return x + 1

    assert attention.guard_forward(forward, ubatched=True)(1) == 2
    assert seen == [False] and len(conn.reconnects) == 1 and conn.forwards_guarded


def test_a_loss_found_after_a_micro_batched_forward_fails_the_step(monkeypatch):
    recorded = []
    monkeypatch.setattr(failure, "record", lambda *a: recorded.append(a))
    conn = FakeConn([None, "lost AFD peer x: connection closed"])
    forward, calls = _recording(["garbage"])
    with pytest.raises(AFDPeerError, match="connection closed; a micro-batched .DBO. step is "
                                           "not re-run"):  # fmt: skip
        rejoin.guard(conn, forward, ubatched=True)()
    assert len(calls) == 1 and conn.reconnects == [] and recorded
    assert conn.forwards_guarded
