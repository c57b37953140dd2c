"""The bound on the tokens of one FFN pass: an FFN rank batches the
steps of its k attention ranks, up to k x max_num_batched_tokens tokens; steps beyond
AFDConfig.ffn_pass_tokens are served in several passes (vllm.afd.ffn_runner). A recording
connector stands in for the network; the module is a function of its rows, so every
attention rank's reply shows whether it got its own rows back."""

from __future__ import annotations

import pytest
import torch
from ffn_fakes import FakeRunner, no_forward_context  # noqa: F401 - the fixture

from vllm.afd import ffn_runner
from vllm.afd import protocol as P
from vllm.distributed.afd.base import StepPeer

HIDDEN = 4
BOUND = 64


class _Conn:
    """Fills a rank's rows with rank + 1; records what the FFN sends back."""

    def __init__(self, steps: list[list[StepPeer]] | None = None):
        self.steps = list(steps or [])
        self.sent: list[tuple[int, list[float]]] = []
        self.waits = 0

    def wait_step(self, timeout):
        self.waits += 1
        return self.steps.pop(0) if self.steps else []

    def recv(self, peer, out):
        out.fill_(peer.rank + 1)

    def send(self, peer, y):
        self.sent.append((peer.rank, y[:, 0].tolist()))


def make_runner(conn, layers=2, bound=BOUND) -> FakeRunner:
    return FakeRunner(conn, layers, HIDDEN, bound)


pytestmark = pytest.mark.usefixtures("no_forward_context")


def steps(*tokens: int) -> list[StepPeer]:
    return [StepPeer(rank, P.Control(P.MSG_STEP, 1, n)) for rank, n in enumerate(tokens)]


# --------------------------------------------------------------------- split_passes
@pytest.mark.parametrize(
    ("tokens", "passes"),
    [
        ((10, 20, 30), [[10, 20, 30]]),
        ((64,), [[64]]),
        ((64, 1), [[64], [1]]),
        ((20, 30, 50), [[20, 30], [50]]),
        ((40, 30, 20, 14), [[40], [30, 20, 14]]),
        ((), []),
    ],
)
def test_split_passes_in_arrival_order_within_the_bound(tokens, passes):
    got = ffn_runner.split_passes(steps(*tokens), BOUND)
    assert [[p.control.num_tokens for p in pas] for pas in got] == passes
    assert [p.rank for pas in got for p in pas] == list(range(len(tokens)))


def test_a_step_above_the_bound_is_refused():
    with pytest.raises(RuntimeError, match="has 65 tokens, above the 64 tokens of one pass"):
        ffn_runner.split_passes(steps(10, 65), BOUND)


# --------------------------------------------------------------------- one FFN rank
def test_steps_beyond_the_bound_run_in_several_passes():
    conn = _Conn()
    r = make_runner(conn)
    r._run_step(steps(20, 30, 50))  # 100 tokens from 3 attention ranks; bound 64
    assert max(r.rows_per_call) <= BOUND
    assert r.rows_per_call == [50, 50, 50, 50]  # (20 + 30, then 50) x 2 layers
    assert (r.steps_served, r.batched_steps, r.split_steps) == (2, 1, 1)
    # pass by pass, layer by layer, every rank got its own rows back (each layer
    # receives afresh: rank r's rows are r + 1, the block's output (r + 1) * 10 + layer)
    expected = [(r, [(r + 1) * 10.0 + layer] * n)
                for pas in [((0, 20), (1, 30)), ((2, 50),)]
                for layer in (0, 1) for r, n in pas]  # fmt: skip
    assert conn.sent == expected


def test_steps_within_the_bound_share_one_pass():
    r = make_runner(_Conn())
    r._run_step(steps(16, 16, 32))
    assert r.rows_per_call == [64, 64]
    assert (r.steps_served, r.batched_steps, r.split_steps) == (1, 1, 0)


# --------------------------------------------------------------------- FFN group
def test_an_ffn_group_member_holds_back_what_is_beyond_the_bound(monkeypatch):
    """A group member contributes at most the bound to a group step; the steps held back
    are served by the next group steps before it waits for new ones."""
    conn = _Conn([steps(20, 30, 50)])
    r = make_runner(conn)
    r.group = object()
    r.rank = 0
    r._group_window = 0.0
    r._group_last_step = r._group_own_step = 0.0
    r.group_steps = 0
    served = []

    def agree(ready, waiting):
        return [torch.tensor([sum(p.control.num_tokens for p in ready), 0, int(waiting)])]

    def body(ready, counts):
        served.append([(p.rank, p.control.num_tokens) for p in ready])
        return 0.0, 0.0

    monkeypatch.setattr(r, "_agree", agree)
    monkeypatch.setattr(r, "_group_step_body", body)
    monkeypatch.setattr(r, "_account", lambda *a, **k: None)
    for _ in range(3):
        r._serve_group_once(0.0)
    assert served == [[(0, 20), (1, 30)], [(2, 50)]]
    assert conn.waits == 2  # the held-back step was served without waiting
    assert r._pending == [] and r.split_steps == 1
