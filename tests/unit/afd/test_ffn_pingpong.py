"""Ping-pong between attention ranks on the FFN rank (connector_extra_config.ffn_schedule
"pingpong", vllm.afd.ffn_runner): the steps of ranks ready together are served interleaved
layer by layer, each hand-over waiting on its own rank's input, each rank's rows in a block
call of their own; one rank alone, micro-batched steps and a lost rank as the joined
schedule serves them. A recording connector stands in for the network; the CPU oracle
(tests/cpu/test_afd_oracle.py::test_oracle_2a1f) runs the real thing."""

from __future__ import annotations

import pytest
import torch
from ffn_fakes import FakeRunner, no_forward_context  # noqa: F401 - the fixture

from vllm.afd import ffn_runner
from vllm.afd import protocol as P
from vllm.distributed.afd.base import StepPeer

HIDDEN = 4
pytestmark = pytest.mark.usefixtures("no_forward_context")


class _Conn:
    """Every received row block of rank r is filled with r + 1 (the reply shows whose input
    a block saw); ``lose`` names a rank whose receive fails at its ``lose_at``-th message."""

    ubatch_controls_upfront = False
    survives_peer_loss = True

    def __init__(self, controls=(), lose: int | None = None, lose_at: int = 0):
        self.controls = list(controls)
        self.log: list[tuple] = []
        self.lose, self.lose_at, self.received = lose, lose_at, {}
        self.dropped: list[int] = []

    def recv_control(self, peer):
        self.log.append(("control", peer.rank))
        return self.controls.pop(0)

    def recv(self, peer, out):
        k = self.received[peer.rank] = self.received.get(peer.rank, 0) + 1
        if peer.rank == self.lose and k >= self.lose_at:
            raise P.AFDPeerError(f"rank {peer.rank} gone")
        out.fill_(peer.rank + 1)
        self.log.append(("recv", peer.rank, out.shape[0]))

    def send(self, peer, y):
        assert torch.all(y == y[0, 0])  # a block saw one rank's rows only
        self.log.append(("send", peer.rank, y.shape[0], y[0, 0].item()))

    def drop_peer(self, peer, why):
        self.dropped.append(peer.rank)


def _step(rank, n, step=7):
    return StepPeer(rank, P.Control(P.MSG_STEP, step, n))


def _runner(conn, schedule="pingpong", layers=2) -> FakeRunner:
    return FakeRunner(conn, layers, HIDDEN, schedule=schedule)


def test_two_ranks_hand_over_layer_by_layer_in_turn():
    conn = _Conn()
    r = _runner(conn)
    r._run_step([_step(1, 3), _step(0, 2)])  # rank 1's step arrived first
    # layer i computes x * 10 + i; rank r's rows hold r + 1
    assert conn.log == [
        ("recv", 1, 3), ("send", 1, 3, 20.0),  # layer 0: rank 1, then rank 0
        ("recv", 0, 2), ("send", 0, 2, 10.0),
        ("recv", 1, 3), ("send", 1, 3, 21.0),  # layer 1: rank 1 again first
        ("recv", 0, 2), ("send", 0, 2, 11.0),
    ]
    assert r.rows_per_call == [3, 2, 3, 2]  # each rank's rows in a block call of their own
    assert (r.steps_served, r.pingpong_steps, r.batched_steps) == (1, 1, 0)


def test_the_joined_schedule_serves_them_in_one_pass():
    # The same round under the default schedule: one block call over both ranks' rows.
    conn = _Conn()
    r = FakeRunner(conn, 1, HIDDEN)
    conn.send = lambda peer, y: conn.log.append(("send", peer.rank, y.shape[0]))
    r._run_step([_step(1, 3), _step(0, 2)])
    assert conn.log == [("recv", 1, 3), ("recv", 0, 2), ("send", 1, 3), ("send", 0, 2)]
    assert r.rows_per_call == [5] and (r.batched_steps, r.pingpong_steps) == (1, 0)


def test_three_ranks_rotate():
    conn = _Conn()
    r = _runner(conn, layers=2)
    r._run_step([_step(0, 1), _step(1, 1), _step(2, 1)])
    assert [(e[1]) for e in conn.log if e[0] == "recv"] == [0, 1, 2, 0, 1, 2]
    assert r.pingpong_steps == 1


def test_one_ready_rank_runs_a_plain_pass():
    conn = _Conn()
    r = _runner(conn)
    r._run_step([_step(0, 2)])
    assert r.rows_per_call == [2, 2] and (r.steps_served, r.pingpong_steps) == (1, 0)


def test_a_micro_batched_step_is_served_alone_then_the_others_interleave():
    ub = P.Control(P.MSG_STEP, 7, 1, P.ubatch_flags(0, 2))
    conn = _Conn([P.Control(P.MSG_STEP, 7, 1, P.ubatch_flags(1, 2))])
    r = _runner(conn, layers=1)
    r._run_step([StepPeer(0, ub), _step(1, 2), _step(2, 3)])
    assert [e[:2] for e in conn.log] == [
        ("recv", 0), ("send", 0), ("control", 0), ("recv", 0), ("send", 0),  # DBO, alone
        ("recv", 1), ("send", 1), ("recv", 2), ("send", 2),
    ]
    assert (r.ubatched_steps, r.pingpong_steps, r.steps_served) == (1, 1, 2)


def test_a_rank_lost_mid_round_leaves_the_other_served():
    conn = _Conn(lose=0, lose_at=2)  # rank 0's layer-1 input fails
    r = _runner(conn, layers=3)
    r._run_step([_step(0, 2), _step(1, 2)])
    assert [e for e in conn.log if e[0] == "send"] == [
        ("send", 0, 2, 10.0), ("send", 1, 2, 20.0),
        ("send", 1, 2, 21.0), ("send", 1, 2, 22.0),  # rank 1 goes on alone
    ]
    assert conn.dropped == [0] and r.peers_lost == 1
    # rank 0's layer-1 block ran on zero rows (as in a joined pass); none after it
    assert r.rows_per_call == [2, 2, 2, 2, 2]


def test_a_step_above_the_pass_bound_is_refused_as_when_joined():
    r = _runner(_Conn())
    r.max_pass_tokens = 4
    with pytest.raises(RuntimeError, match=r"attention rank 1 has 5 tokens, above the 4"):
        r._run_step([_step(0, 2), _step(1, 5)])


def test_the_schedule_key():
    assert ffn_runner.ffn_schedule({}) == "join"
    assert ffn_runner.ffn_schedule({"ffn_schedule": "pingpong"}) == "pingpong"
    with pytest.raises(ValueError, match=r"ffn_schedule must be one of 'join', 'pingpong', "
                                         r"'auto'; got 'pp'"):
        ffn_runner.ffn_schedule({"ffn_schedule": "pp"})
    with pytest.raises(ValueError, match=r"ffn_schedule 'pingpong': an FFN group"):
        ffn_runner.ffn_schedule({"ffn_schedule": "pingpong"}, grouped=True)
    with pytest.raises(ValueError, match=r"ffn_schedule 'auto': an FFN group"):
        ffn_runner.ffn_schedule({"ffn_schedule": "auto"}, grouped=True)
    assert ffn_runner.ffn_schedule({"ffn_schedule": "join"}, grouped=True) == "join"


# ------------------------------------------------------------ ffn_schedule "auto"
def test_auto_probes_both_schedules_then_keeps_the_shorter_rounds():
    auto, key = ffn_runner.AutoSchedule(), ((0, 4), (1, 4))
    probes = 2 * auto.PROBES
    chosen = []
    for _ in range(probes):
        chosen.append(auto.choose(key))
        auto.record(key, chosen[-1], {"join": 0.010, "pingpong": 0.007}[chosen[-1]])
    assert chosen == ["join", "pingpong"] * auto.PROBES  # alternating, join first
    chosen = [auto.choose(key) for _ in range(auto.REPROBE)]
    # rounds probes+1 .. probes+REPROBE: the shorter one, the other on every REPROBE-th
    assert chosen.count("join") == 1 and chosen.index("join") == auto.REPROBE - probes - 1
    # the interleaved rounds grow longer than the joined ones: the choice follows the
    # medians of the last PROBES periods
    for _ in range(auto.PROBES // 2 + 1):
        auto.record(key, "pingpong", 0.012)
    assert auto.choose(key) == "join"
    auto.record(((5, 1),), "join", 1.0)  # a composition never chosen for: ignored
    assert ((5, 1),) not in auto.periods


def test_auto_rounds_are_timed_from_one_round_of_a_composition_to_the_next(monkeypatch):
    """The runner under "auto": a round's period (its start to the next round's start)
    counts for its schedule only when the next round has the same ranks and tokens."""
    clock = [0.0]
    monkeypatch.setattr(ffn_runner.time, "perf_counter", lambda: clock[0])
    r = _runner(_Conn(), schedule="auto", layers=1)
    cost = {"join": 0.010, "pingpong": 0.006}
    served = []

    def round_(ready):
        before = r.pingpong_steps
        r._run_step(ready)
        served.append("pingpong" if r.pingpong_steps > before else "join")
        clock[0] += cost[served[-1]]

    pair = [_step(0, 2), _step(1, 3)]
    round_(pair)
    round_([_step(0, 2)])  # another composition: the pair's first period is dropped
    round_([_step(1, 3), _step(0, 2)])  # the same ranks and tokens in another order
    assert served == ["join", "join", "join"]
    for _ in range(2 * r._auto.PROBES):
        round_(pair)
    key = ((0, 2), (1, 3))
    assert [len(d) for d in r._auto.periods[key].values()] == [r._auto.PROBES] * 2
    assert list(r._auto.periods[key]["pingpong"]) == pytest.approx([0.006] * r._auto.PROBES)
    for _ in range(5):
        round_(pair)
    assert served[-5:] == ["pingpong"] * 5 and r.batched_steps == r._auto.PROBES + 1
    # a micro-batched step in the round, or one rank: joined, not timed
    assert r._round_schedule([StepPeer(0, P.Control(P.MSG_STEP, 7, 2, P.ubatch_flags(0, 2))),
                              _step(1, 3)]) == "join"
    assert r._auto_last is None
