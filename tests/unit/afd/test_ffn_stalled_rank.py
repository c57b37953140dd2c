"""One attention rank that stops (SIGSTOP, a paused VM, a cut link) must not stall the other
ranks of its FFN rank: the FFN rank's serve loop (vllm.afd.ffn_runner's, with a fake model)
over real sockets on 127.0.0.1 (the TCP connector), two attention ranks, one of which stops
mid-frame - in a layer input of a pass the two share, in a control frame between steps, in a
micro-batched (DBO) step, or by no longer reading its outputs; and over the nixl data plane
(real NIXL agents), a rank that stops in a shared pass or in its micro-batched step.

Checked: every layer of the healthy rank comes back within STALL_BOUND_S (the serve loop
waits STRAGGLER_S for a late rank of a shared pass, then goes on without it), with the right
outputs; the stopped rank is dropped at its own deadline (timeout_s after its last byte,
not before) with the reason in the FFN's log; a late rank that resumes before its deadline
finishes its step on its own with the right outputs. Before, the FFN rank read its ranks one
after another, each read blocking up to timeout_s: the healthy rank waited timeout_s (and,
with the same timeout_s, lost its own connection first)."""

from __future__ import annotations

import threading
import time

import pytest
import tcp_lib
import torch
from ffn_fakes import FakeRunner, no_forward_context  # noqa: F401 - the fixture
from tcp_lib import HIDDEN, Bg, wait_until

from serve_util import free_port
from vllm.afd import ffn_runner
from vllm.afd import protocol as P
from vllm.distributed.afd import tcp
from vllm.distributed.afd.channel import tensor_bytes

net = tcp_lib.net  # the fixture
pytestmark = pytest.mark.usefixtures("no_forward_context")

TIMEOUT = 3.0  # timeout_s of every side: the stopped rank's own deadline
STALL_BOUND_S = 1.0  # the longest a layer of the healthy rank may take
LAYERS = 4


class Serving:
    """FFNModelRunner's serve loop (its _serve, in a thread) with LAYERS fake blocks,
    layer i computing x * 10 + i."""

    def __init__(self, ffn: tcp.TCPFFNConnector, hidden: int = HIDDEN, schedule: str = "join"):
        r = self.runner = FakeRunner(ffn, LAYERS, hidden, schedule=schedule)
        r._stop, r._profile_lock, r._profile_local = threading.Event(), threading.Lock(), []
        r.group, r.error, r.rank, r.on_fatal = None, None, 0, []
        self.thread = threading.Thread(target=r._serve, daemon=True)
        self.thread.start()

    def stop(self):
        self.runner._stop.set()
        self.thread.join(5)
        assert self.runner.error is None, self.runner.error


@pytest.fixture
def serving():
    started: list[Serving] = []

    def start(ffn, **kw):
        started.append(Serving(ffn, **kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def ranks(net, hidden: int = HIDDEN, stopped_first: bool = False):
    """An FFN rank of two attention ranks: rank 0 healthy (heartbeats between its steps),
    rank 1 the one that stops (no heartbeats: a stopped process sends nothing). With
    ``stopped_first`` rank 1 is accepted first (the FFN serves a pass's ranks in that
    order)."""
    port = free_port()
    ffn = net.ffn(port, m=2, timeout=TIMEOUT)
    ffn.start()
    healthy = net.attention(port, rank=0, m=2, timeout=TIMEOUT)
    stopped = net.attention(port, rank=1, m=2, timeout=TIMEOUT)
    stopped._heartbeat_loop = lambda: None
    for att in (stopped, healthy) if stopped_first else (healthy, stopped):
        Bg(att.connect).get()
        wait_until(lambda a=att: a.ctx.rank in ffn.peers, what="rank accepted")
    return ffn, healthy, stopped


def layer(att, x: torch.Tensor, i: int) -> float:
    """Send one layer's input, check its output (x * 10 + i); the round trip's seconds."""
    t0 = time.monotonic()
    att.send(x)
    y = att.recv(torch.empty_like(x))
    took = time.monotonic() - t0
    assert torch.equal(y, x * 10 + i), f"layer {i}"
    return took


def healthy_steps(att, first_id: int, n: int = 2, count: int = 3, start: int = 0) -> float:
    """``count`` whole steps of the healthy rank from layer ``start`` of the first (its
    step already begun when ``start`` > 0); the longest layer round trip."""
    worst = 0.0
    for k in range(count):
        if k or not start:
            att.begin_step(first_id + k, n)
        for i in range(start if k == 0 else 0, LAYERS):
            worst = max(worst, layer(att, torch.randn(n, HIDDEN), i))
        att.end_step()
    return worst


def stop_mid_frame(att, x: torch.Tensor) -> float:
    """Half of ``x``'s bytes on the wire, then nothing (the process stopped): when the
    last byte went."""
    with att._lock:
        att.sock.sendall(tensor_bytes(x)[: x.numel() * x.element_size() // 2])
    return time.monotonic()


def dropped_at(ffn, rank: int, since: float) -> tuple[float, str]:
    """Seconds from ``since`` until the FFN rank dropped ``rank``, and why."""
    wait_until(lambda: rank not in ffn.peers, TIMEOUT + 3, what=f"rank {rank} dropped")
    return time.monotonic() - since, ffn.lost[rank]


def assert_own_deadline(took: float, why: str, reason: str) -> None:
    print(f"stopped rank dropped {took:.2f} s after its last byte: {why}")
    assert TIMEOUT - 0.1 <= took <= TIMEOUT + 1.0, took
    assert reason in why, why


def test_a_rank_stopped_mid_frame_in_a_shared_pass_does_not_stall_the_other(net, serving):
    ffn, healthy, stopped = ranks(net)
    healthy.begin_step(1, 2)
    stopped.begin_step(1, 3)
    s = serving(ffn)  # both steps wait on the sockets: they share the first pass
    x0, x1 = torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)
    healthy.send(x0)
    stopped.send(x1)
    assert torch.equal(healthy.recv(torch.empty(2, HIDDEN)), x0 * 10)
    assert torch.equal(stopped.recv(torch.empty(3, HIDDEN)), x1 * 10)
    last_byte = stop_mid_frame(stopped, torch.randn(3, HIDDEN))  # layer 1, half of it
    worst = healthy_steps(healthy, 1, start=1)  # the rest of step 1, then steps 2 and 3
    print(f"healthy rank: longest layer round trip {worst:.3f} s")
    assert worst < STALL_BOUND_S
    assert s.runner.straggler_splits == 1  # the pass went on without the stopped rank
    assert 1 in ffn.peers  # its own deadline has not passed yet
    took, why = dropped_at(ffn, 1, last_byte)
    assert_own_deadline(took, why, "AFD peer attention rank 1 at 127.0.0.1:")
    assert "did not answer within the timeout" in why
    assert healthy_steps(healthy, 10) < STALL_BOUND_S and healthy.is_up()
    assert s.runner.peers_lost == 1
    wait_until(lambda: not s.runner._tasks, what="the stopped rank's pass forgotten")


def test_interleaved_ranks_one_stopped_mid_frame_the_other_is_not_held(net, serving):
    """ffn_schedule pingpong: each rank's step is a pass of its own, interleaved layer by
    layer; the stopped rank's pass waits alone, and the other's layers of the same round go
    on at once, without the STRAGGLER_S wait of a shared pass before its split. Its next
    step waits, once, until the stopped rank's pass parks (STRAGGLER_S after its input was
    posted), as the serve loop takes new steps only then."""
    ffn, healthy, stopped = ranks(net)
    healthy.begin_step(1, 2)
    stopped.begin_step(1, 3)
    s = serving(ffn, schedule="pingpong")  # both steps ready at once: one round
    x0, x1 = torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)
    healthy.send(x0)
    stopped.send(x1)
    assert torch.equal(healthy.recv(torch.empty(2, HIDDEN)), x0 * 10)
    assert torch.equal(stopped.recv(torch.empty(3, HIDDEN)), x1 * 10)
    last_byte = stop_mid_frame(stopped, torch.randn(3, HIDDEN))  # layer 1, half of it
    rest = max(layer(healthy, torch.randn(2, HIDDEN), i) for i in range(1, LAYERS))
    healthy.end_step()
    worst = healthy_steps(healthy, 2, count=2)
    print(f"healthy rank: rest of the round's step {rest:.3f} s a layer at most, "
          f"longest layer round trip after {worst:.3f} s")
    assert rest < ffn_runner.STRAGGLER_S  # a shared pass waits STRAGGLER_S here
    assert worst < STALL_BOUND_S
    assert s.runner.straggler_splits == 0 and s.runner.batched_steps == 0
    assert s.runner.pingpong_steps >= 1
    took, why = dropped_at(ffn, 1, last_byte)
    assert_own_deadline(took, why, "did not answer within the timeout")
    wait_until(lambda: s.runner.peers_lost == 1 and not s.runner._tasks,
               what="the stopped rank's pass ended")  # fmt: skip


def test_a_rank_stopped_mid_control_frame_between_steps_does_not_stall_the_other(
    net, serving
):
    """Between steps the FFN read a control frame that had begun to arrive to its end."""
    ffn, healthy, stopped = ranks(net)
    s = serving(ffn)
    with stopped._lock:
        stopped.sock.sendall(P.Control(P.MSG_STEP, 1, 2).pack()[:7])
    last_byte = time.monotonic()
    time.sleep(0.1)  # the FFN has seen the partial frame
    t0 = time.monotonic()
    worst = healthy_steps(healthy, 1)
    print(f"healthy rank: 3 steps in {time.monotonic() - t0:.3f} s, longest layer {worst:.3f} s")
    assert time.monotonic() - t0 < STALL_BOUND_S
    took, why = dropped_at(ffn, 1, last_byte)
    assert_own_deadline(took, why, f"nothing received for {TIMEOUT:g} s")
    assert healthy_steps(healthy, 10) < STALL_BOUND_S
    assert s.runner.straggler_splits == 0  # no pass of the stopped rank


def test_a_rank_stopped_in_its_micro_batched_step_does_not_stall_the_other(net, serving):
    """A DBO step is served on its own (layer by layer, micro-batch by micro-batch): its
    rank stopping mid-frame parks it, and the other rank's steps are served meanwhile."""
    ffn, healthy, stopped = ranks(net, stopped_first=True)
    stopped.begin_step(1, 3, ubatch=(0, 2))
    healthy.begin_step(1, 2)
    s = serving(ffn)
    last_byte = stop_mid_frame(stopped, torch.randn(3, HIDDEN))  # micro-batch 0, layer 0
    worst = 0.0
    for i in range(LAYERS):  # step 1, begun above
        worst = max(worst, layer(healthy, torch.randn(2, HIDDEN), i))
    healthy.end_step()
    worst = max(worst, healthy_steps(healthy, 2))
    print(f"healthy rank: longest layer round trip {worst:.3f} s")
    assert worst < STALL_BOUND_S
    took, why = dropped_at(ffn, 1, last_byte)
    assert_own_deadline(took, why, "did not answer within the timeout")
    wait_until(lambda: s.runner.peers_lost == 1 and not s.runner._tasks,
               what="the runner's pass of rank 1 ended")  # fmt: skip
    assert s.runner.ubatched_steps == 0


def test_a_rank_that_stops_reading_does_not_stall_the_other(net, serving):
    """The stopped rank's layer output (16 MiB) does not fit the socket buffers: the FFN
    rank, sending to it first, once blocked in that send for timeout_s."""
    hidden = 1 << 18  # 16 tokens x 262144 float32 = 16 MiB
    ffn, healthy, stopped = ranks(net, hidden=hidden, stopped_first=True)
    stopped.begin_step(1, 16)
    healthy.begin_step(1, 1)
    s = serving(ffn, hidden=hidden)
    stopped.send(torch.randn(16, hidden))  # then it reads nothing more
    last_byte = time.monotonic()
    worst = 0.0
    for i in range(LAYERS):
        x = torch.randn(1, hidden)
        worst = max(worst, layer(healthy, x, i))
    healthy.end_step()
    print(f"healthy rank: longest layer round trip {worst:.3f} s")
    assert worst < STALL_BOUND_S
    took, why = dropped_at(ffn, 1, last_byte)
    print(f"stopped rank dropped {took:.2f} s after its input arrived: {why}")
    assert TIMEOUT - 0.1 <= took <= TIMEOUT + 1.5, took
    assert "stopped reading (send timed out)" in why
    wait_until(lambda: s.runner.peers_lost == 1, what="the runner's pass of rank 1 ended")


def test_a_late_rank_that_resumes_before_its_deadline_finishes_its_step(net, serving):
    """Late by 2 s (< timeout_s) in a shared pass: the other rank goes on at once; the late
    rank's pass continues on its own once its bytes come, with the right outputs."""
    ffn, healthy, stopped = ranks(net)
    healthy.begin_step(1, 2)
    stopped.begin_step(1, 3)
    s = serving(ffn)
    xs = [torch.randn(3, HIDDEN) for _ in range(LAYERS)]
    x0 = torch.randn(2, HIDDEN)
    healthy.send(x0)
    stopped.send(xs[0])
    assert torch.equal(healthy.recv(torch.empty(2, HIDDEN)), x0 * 10)
    assert torch.equal(stopped.recv(torch.empty(3, HIDDEN)), xs[0] * 10)
    stop_mid_frame(stopped, xs[1])
    worst = healthy_steps(healthy, 1, start=1)
    assert worst < STALL_BOUND_S
    time.sleep(2.0)
    with stopped._lock:  # it resumes: the rest of layer 1's input
        stopped.sock.sendall(tensor_bytes(xs[1])[xs[1].numel() * 4 // 2 :])
    assert torch.equal(stopped.recv(torch.empty(3, HIDDEN)), xs[1] * 10 + 1)
    for i in range(2, LAYERS):
        assert layer(stopped, xs[i], i) < STALL_BOUND_S
    stopped.end_step()
    assert 1 in ffn.peers and s.runner.peers_lost == 0
    assert s.runner.straggler_splits == 1
    # both are served on, together again
    for step_id in (5, 6):
        healthy.begin_step(step_id, 2)
        stopped.begin_step(step_id, 1)
        for i in range(LAYERS):
            a, b = torch.randn(2, HIDDEN), torch.randn(1, HIDDEN)
            healthy.send(a)
            stopped.send(b)
            assert torch.equal(healthy.recv(torch.empty(2, HIDDEN)), a * 10 + i)
            assert torch.equal(stopped.recv(torch.empty(1, HIDDEN)), b * 10 + i)
        healthy.end_step()
        stopped.end_step()


# ------------------------------------------------------------------ the nixl data plane
# The same guarantee over connector nixl (real NIXL agents over UCX on 127.0.0.1): the
# activations are one-sided writes with notifications, not bytes of the channel's
# connection. Each side drives its own agent (no progress thread): the healthy rank while
# it waits, the FFN rank in its serve loop; the stopped rank's agent is driven no more.
def nixl_ranks(net):
    """As :func:`ranks`, over connector nixl: an FFN rank of two attention ranks, rank 1
    the one that stops (no heartbeats)."""
    from vllm.distributed.afd.base import create_attention_connector, create_ffn_connector

    port = free_port()
    ffn = create_ffn_connector(tcp_lib.make_ctx("ffn", port, m=2, timeout=TIMEOUT,
                                                connector="nixl"))  # fmt: skip
    net.items.append(ffn)
    ffn.start()
    atts = []
    for rank in (0, 1):
        att = create_attention_connector(tcp_lib.make_ctx("attention", port, rank=rank, m=2,
                                                          timeout=TIMEOUT, connector="nixl"))
        net.items.append(att)
        atts.append(att)
    healthy, stopped = atts
    stopped._heartbeat_loop = lambda: None
    for att in atts:
        Bg(att.connect).get()
        wait_until(lambda a=att: a.ctx.rank in ffn.peers, what="rank accepted")
    assert type(ffn.plane).__name__ == "NixlFFNPlane"
    return ffn, healthy, stopped


def nixl_micro_batched_step(att, step_id: int, n: int = 2) -> float:
    """A DBO step of 2 micro-batches from one thread, as the FFN rank serves it (layer by
    layer, micro-batch 0 then 1; each micro-batch's messages on its own lane); the longest
    layer round trip."""
    worst = 0.0
    att.begin_step(step_id, n, ubatch=(0, 2))
    for i in range(LAYERS):
        for mb in range(2):
            if i == 0 and mb == 1:
                att.begin_step(step_id, n, ubatch=(1, 2))
            att._lanes.lane = mb
            worst = max(worst, layer(att, torch.randn(n, HIDDEN), i))
    att.end_step()
    return worst


def test_nixl_a_rank_stopped_in_a_shared_pass_does_not_stall_the_other(net, serving):
    """Rank 1 sends its control and its first layer input, then nothing (its agent is no
    longer driven either): the FFN rank waits for the notifications of every posted
    message at once, splits rank 1 out of the shared pass STRAGGLER_S after rank 0's input
    came and drops it at its own deadline. Rank 1's reply write never completes (over UCX
    it needs the stopped agent's progress): posted, it holds no one either. Before, the
    FFN rank waited for that write, then for rank 1's notification, alone for timeout_s,
    holding rank 0 (which timed out first)."""
    ffn, healthy, stopped = nixl_ranks(net)
    healthy.begin_step(1, 2)
    stopped.begin_step(1, 3)
    s = serving(ffn)  # both steps wait: they share the first pass
    x0 = torch.randn(2, HIDDEN)
    healthy.send(x0)
    stopped.send(torch.randn(3, HIDDEN))  # layer 0; its reply is never read
    last_message = time.monotonic()
    assert torch.equal(healthy.recv(torch.empty(2, HIDDEN)), x0 * 10)
    worst = healthy_steps(healthy, 1, start=1)  # the rest of step 1, then steps 2 and 3
    print(f"healthy rank (nixl): longest layer round trip {worst:.3f} s")
    assert worst < STALL_BOUND_S
    assert s.runner.straggler_splits == 1  # the pass went on without the stopped rank
    assert 1 in ffn.peers  # its own deadline has not passed yet
    took, why = dropped_at(ffn, 1, last_message)
    assert_own_deadline(took, why, "AFD peer attention rank 1 at 127.0.0.1:")
    assert "did not answer within the timeout" in why
    assert healthy_steps(healthy, 10) < STALL_BOUND_S and healthy.is_up()
    assert s.runner.peers_lost == 1
    wait_until(lambda: not s.runner._tasks, what="the stopped rank's pass forgotten")
    assert set(ffn.plane.sessions) == {0}  # the stopped rank's registrations ended


def test_nixl_a_rank_stopped_in_its_micro_batched_step_does_not_stall_the_other(
    net, serving
):
    """Rank 1 stops after micro-batch 0's first layer input of a DBO step; rank 0 runs DBO
    steps (messages on lanes 0 and 1) and plain steps meanwhile, each layer at once."""
    ffn, healthy, stopped = nixl_ranks(net)
    stopped.begin_step(1, 3, ubatch=(0, 2))
    s = serving(ffn)
    stopped.send(torch.randn(3, HIDDEN))  # micro-batch 0, layer 0: its reply never read
    last_message = time.monotonic()
    time.sleep(0.05)  # the FFN rank is in rank 1's step (waits for micro-batch 1's control)
    worst = max(nixl_micro_batched_step(healthy, 1), healthy_steps(healthy, 2),
                nixl_micro_batched_step(healthy, 5))  # fmt: skip
    print(f"healthy rank (nixl, DBO): longest layer round trip {worst:.3f} s")
    assert worst < STALL_BOUND_S
    assert 1 in ffn.peers
    took, why = dropped_at(ffn, 1, last_message)
    assert_own_deadline(took, why, "did not answer within the timeout")
    wait_until(lambda: s.runner.peers_lost == 1 and not s.runner._tasks,
               what="the runner's pass of rank 1 ended")  # fmt: skip
    assert s.runner.ubatched_steps == 2  # the healthy rank's, served whole


def test_nixl_a_rank_that_ends_its_session_mid_step_is_dropped_at_once(net, serving):
    """Rank 1 fails part-way through a step and shuts its connection down (as a failed step
    or a failure its plane found does): the FFN rank, waiting for its next layer input (a
    notification, nothing on the socket), sees the EOF and ends the session at once, not
    at its deadline; rank 0 is served meanwhile and after."""
    ffn, healthy, stopped = nixl_ranks(net)
    stopped.begin_step(1, 3)
    s = serving(ffn)
    x = torch.randn(3, HIDDEN)
    stopped.send(x)
    assert torch.equal(stopped.recv(torch.empty(3, HIDDEN)), x * 10)
    time.sleep(0.1)  # the FFN rank waits for rank 1's layer 1 input
    closed = time.monotonic()
    with stopped._lock:
        stopped._fail(P.AFDPeerError("the data plane failed"), "a test")
    took, why = dropped_at(ffn, 1, closed)
    print(f"rank 1 dropped {took:.3f} s after it shut its connection down: {why}")
    assert took < STALL_BOUND_S
    assert "attention rank 1" in why and "closed the connection" in why
    assert healthy_steps(healthy, 1) < STALL_BOUND_S
    wait_until(lambda: s.runner.peers_lost == 1 and not s.runner._tasks,
               what="the runner's pass of rank 1 ended")  # fmt: skip
