"""The FFN rank's service of micro-batched (DBO) steps (vllm.afd.ffn_runner): the
order it receives, computes and sends in, and its checks on the later micro-batches'
control messages. A recording connector stands in for the network; the CPU oracle
(tests/cpu/test_afd_oracle.py::test_oracle_dbo) runs the real thing."""

from __future__ import annotations

import pytest
from ffn_fakes import FakeRunner, no_forward_context  # noqa: F401 - the fixture

from vllm.afd import protocol as P
from vllm.distributed.afd.base import StepPeer

HIDDEN = 4


class _Conn:
    """Serves canned controls; every received row block is filled with the
    micro-batch index + 1 (so the reply shows which input the block saw)."""

    # what FFNConnector declares: a later micro-batch's control comes when it is asked for,
    # and a lost attention rank ends the FFN rank
    ubatch_controls_upfront = False
    survives_peer_loss = False

    def __init__(self, controls):
        self.controls = list(controls)
        self.log: list[tuple] = []

    def recv_control(self, peer):
        self.log.append(("control",))
        return self.controls.pop(0)

    def recv(self, peer, out):
        out.fill_(P.ubatch_of(peer.control.flags)[0] + 1)
        self.log.append(("recv", P.ubatch_of(peer.control.flags)[0], out.shape[0]))

    def send(self, peer, y):
        self.log.append(("send", P.ubatch_of(peer.control.flags)[0], y.shape[0], y[0, 0].item()))


def make_runner(conn, layers=2) -> FakeRunner:
    return FakeRunner(conn, layers, HIDDEN)


pytestmark = pytest.mark.usefixtures("no_forward_context")


def _ctrl(index, count, n, step=7):
    return P.Control(P.MSG_STEP, step, n, P.ubatch_flags(index, count))


def test_micro_batches_alternate_layer_by_layer():
    conn = _Conn([_ctrl(1, 2, 2)])
    r = make_runner(conn)
    r._run_step([StepPeer(0, _ctrl(0, 2, 3))])
    assert conn.log == [
        ("recv", 0, 3), ("send", 0, 3, 10.0),  # layer 0, micro-batch 0 (3 tokens)
        ("control",), ("recv", 1, 2), ("send", 1, 2, 20.0),  # its control, then layer 0
        ("recv", 0, 3), ("send", 0, 3, 11.0),  # layer 1 (x * 10 + 1)
        ("recv", 1, 2), ("send", 1, 2, 21.0),
    ]
    assert (r.steps_served, r.ubatched_steps, r.batched_steps) == (1, 1, 0)


def test_a_plain_step_ready_at_the_same_time_is_served_too():
    conn = _Conn([_ctrl(1, 2, 1)])
    r = make_runner(conn, layers=1)
    r._run_step([StepPeer(0, _ctrl(0, 2, 1)), StepPeer(1, P.Control(P.MSG_STEP, 3, 5))])
    assert [e for e in conn.log if e[0] == "send"] == [
        ("send", 0, 1, 10.0), ("send", 1, 1, 20.0), ("send", 0, 5, 10.0)
    ]
    assert (r.steps_served, r.ubatched_steps) == (2, 1)


@pytest.mark.parametrize(
    "first, later, message",
    [
        (_ctrl(1, 2, 2), [], r"opened a step with micro-batch 1 of 2 \(expected 0\)"),
        (_ctrl(0, 2, 2), [_ctrl(1, 2, 2, step=8)], r"expected micro-batch 1 of 2 of step 7, got "
                                                   r"step 8"),
        (_ctrl(0, 2, 2), [_ctrl(0, 2, 2)], r"expected micro-batch 1 of 2"),
        (_ctrl(0, 2, 2), [P.Control(P.MSG_STEP, 7, 2)], r"expected micro-batch 1 of 2"),
    ],
)
def test_out_of_order_micro_batches_are_a_peer_error(first, later, message):
    r = make_runner(_Conn(later))
    with pytest.raises(P.AFDPeerError, match=message):
        r._run_step([StepPeer(0, first)])
