"""The host proxy of the nixl plane's device path (vllm.distributed.afd.nixl_device), on the
CPU: the records a kernel would store are written here, the agent is a fake that records
the writes it is asked to post and hands out the notifications the test queues. Covered:
the doorbell (a record posts exactly one write, per lane, in order; a stale record posts
nothing), the reply flag (advanced over replies received in order only), the step control
sent on, a lost reply (the device wait's error word ends the session by name), a failed
post, the report of where the time went (the host's timings beside the device waits'
durations; at the process's exit too), the release and a new session starting from
message 0, and the shutdown."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from overlay_import import child_env

from vllm.distributed.afd import nixl_device as nd

LANES = 2


class FakeAgent:
    def __init__(self):
        self.lock = threading.Lock()
        self.notes: list[tuple[str, str, int, int]] = []  # (peer, sid, lane, seq)
        self.polls = 0

    def poll(self, who):
        self.polls += 1

    def done(self, handle, who):
        return True

    def take_notes(self, peer, sid):
        with self.lock:
            mine = [(n[2], n[3]) for n in self.notes if n[0] == peer and n[1] == sid]
            self.notes = [n for n in self.notes if not (n[0] == peer and n[1] == sid)]
        return mine

    def reply(self, peer, sid, lane, seq):
        with self.lock:
            self.notes.append((peer, sid, lane, seq))


class Session:
    """What the plane gives the proxy for one session, recording what it is asked."""

    def __init__(self, sid="s1", peer="ffn-agent", fail_write=False, fail_control=False):
        self.writes: list[tuple[int, int, int, str]] = []
        self.controls: list[tuple[int, int]] = []
        self.losses: list[str] = []
        self.fail_write, self.fail_control = fail_write, fail_control
        self.target = nd.Target(sid, peer, self.write, self.control, self.losses.append)

    def write(self, lane, seq, nbytes, note):
        if self.fail_write:
            raise RuntimeError("UCX: endpoint closed")
        self.writes.append((lane, seq, nbytes, note))
        return object()

    def control(self, tokens, flags):
        if self.fail_control:
            raise RuntimeError("connection reset")
        self.controls.append((tokens, flags))


def wait_until(cond, timeout=5.0, what="condition"):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


@pytest.fixture
def rig():
    agent = FakeAgent()
    records, controls = nd.HostWords(LANES * nd.RING), nd.HostWords(nd.RING)
    flags, err = nd.HostWords(LANES), nd.HostWords(1)
    waited = nd.HostWords(LANES * nd.WAIT_KEEP)
    proxy = nd.Proxy(agent, records, controls, flags, LANES, spin_s=0.0, err=err,
                     waited=waited)  # fmt: skip
    yield agent, proxy, records, controls, flags, err
    proxy.stop()


def ring(records, lane, seq, nbytes):
    """What the device's send does: the record of message ``seq`` in the lane's ring."""
    records.words[lane * nd.RING + seq % nd.RING] = nd.record(seq, nbytes)


def test_each_record_posts_one_write_per_lane_in_order_and_stale_ones_none(rig):
    agent, proxy, records, _, _, _ = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0")
    ring(records, 0, 0, 4096)
    ring(records, 1, 0, 512)
    wait_until(lambda: len(s.writes) == 2, what="two posts")
    assert sorted(s.writes) == [(0, 0, 4096, "s1:0:0"), (1, 0, 512, "s1:1:0")]
    # a record whose stamp is not the next message's (a ring slot of an older message)
    records.words[0 * nd.RING + 1] = nd.record(1 + nd.RING, 64)
    time.sleep(0.05)
    assert len(s.writes) == 2
    # more messages than ring slots: each posted once, in order, with its own size
    for seq in range(1, 3 * nd.RING):
        ring(records, 0, seq, 100 + seq)
        wait_until(lambda seq=seq: s.writes[-1][:2] == (0, seq), what=f"message {seq}")
    lane0 = [w for w in s.writes if w[0] == 0]
    assert [w[1] for w in lane0] == list(range(3 * nd.RING))
    assert [w[2] for w in lane0[1:]] == [100 + q for q in range(1, 3 * nd.RING)]


def test_the_flag_advances_over_replies_received_in_order_only(rig):
    agent, proxy, _, _, flags, _ = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0")
    agent.reply("ffn-agent", "s1", 0, 1)  # reply 1 before reply 0
    agent.reply("other-agent", "s1", 0, 0)  # another agent's notification: not ours
    agent.reply("ffn-agent", "old-session", 0, 0)  # an ended session's: not ours
    time.sleep(0.05)
    assert flags.words[0] == 0 and flags.words[1] == 0
    agent.reply("ffn-agent", "s1", 0, 0)
    wait_until(lambda: flags.words[0] == 2, what="flag 2")
    agent.reply("ffn-agent", "s1", 1, 0)
    wait_until(lambda: flags.words[1] == 1, what="lane 1's flag")
    assert flags.words[0] == 2


def test_the_proxy_times_its_posts_and_the_peers_turns_and_logs_them_per_session(rig, caplog):
    agent, proxy, records, _, flags, _ = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0")
    for seq in range(3):  # two messages a layer (hidden states, router logits), one reply
        ring(records, 0, 2 * seq, 4096)
        ring(records, 0, 2 * seq + 1, 256)
        wait_until(lambda seq=seq: len(s.writes) == 2 * seq + 2, what=f"layer {seq}'s posts")
        time.sleep(0.02)  # the peer's turn
        agent.reply("ffn-agent", "s1", 0, seq)
        wait_until(lambda seq=seq: flags.words[0] == seq + 1, what=f"reply {seq}")
    m = proxy.stats.summary()
    assert m["posts"] == 6 and m["replies"] == 3, m
    assert 0 < m["post_us"] < 20_000 and m["poll_us"] > 0, m
    assert 20_000 <= m["turn_us"] < 1_000_000, m  # from the last post to the reply
    # what the device's wait kernel stores: each wait's duration in ns, + 1, by message
    waited = proxy.waited.words
    for k, ns in enumerate([60_000, 50_000, 70_000]):
        waited[k + 1] = ns + 1
    with caplog.at_level("INFO", logger=nd.logger.name):
        proxy.release(None)
    line = [r.getMessage() for r in caplog.records if "nixl proxy of FFN rank 0" in r.getMessage()]
    assert len(line) == 1 and "6 writes posted, 3 replies" in line[0], line
    assert "device wait for a reply 60.0 us" in line[0], line
    turn = float(line[0].split("turn (last write posted to its reply) ")[1].split(" us")[0])
    assert f"(the last 3; less their turn, {turn:.1f} us: {60.0 - turn:.1f} us" in line[0], line
    assert not waited.any()  # taken: the next report counts its own
    # a new session counts from nothing
    proxy.serve(Session(sid="s2").target, "FFN rank 0")
    assert proxy.stats.summary()["posts"] == 0


def test_taking_the_stats_takes_the_device_waits_and_counts_anew(rig):
    agent, proxy, records, _, _, _ = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0")
    ring(records, 0, 0, 4096)
    wait_until(lambda: len(s.writes) == 1, what="a post")
    proxy.waited.words[nd.WAIT_KEEP + 1] = 9_000 + 1  # lane 1's first wait: 9 us
    taken = proxy.take_stats()
    assert taken.posts == 1 and taken.summary()["wait_us"] == 9.0
    assert not proxy.waited.words.any()
    again = proxy.take_stats()
    assert again.posts == 0 and again.wait == []


def test_the_wait_is_set_against_the_turns_of_the_same_last_writes():
    """The device keeps only the last waits of a lane: the turn set against them is the
    median of as many last replies, not of the whole report period (a prefill's long
    turns early in it made the difference negative)."""
    st = nd.ProxyStats()
    st.turn.extend([900e-6] * 100 + [40e-6] * 4)
    st.posts = st.replies = 104
    waited = nd.HostWords(nd.WAIT_KEEP)
    waited.words[:4] = 70_000 + 1
    st.take_waits(waited)
    m = st.summary()
    assert m["turn_us"] == 900.0 and m["turn_waited_us"] == 40.0, m
    assert "(the last 4; less their turn, 40.0 us: 30.0 us of wake-up, post and flag)" in st.line()


def test_serving_another_session_reports_the_ended_ones_device_waits(rig, caplog):
    """The plane resets its device state between sessions without clearing the waits'
    durations: the report at the next serve() takes the ended session's."""
    agent, proxy, records, _, _, _ = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0")
    ring(records, 0, 0, 4096)
    wait_until(lambda: len(s.writes) == 1, what="a post")
    proxy.waited.words[1] = 12_000 + 1
    with caplog.at_level("INFO", logger=nd.logger.name):
        proxy.serve(Session(sid="s2").target, "FFN rank 0")
    line = [r.getMessage() for r in caplog.records if "nixl proxy of FFN rank 0" in r.getMessage()]
    assert len(line) == 1 and "1 writes posted" in line[0], line
    assert "device wait for a reply 12.0 us" in line[0], line


EXIT_SCRIPT = """
import time
import overlay_import
overlay_import.install()  # the AFD modules as they are in the tree
from vllm.distributed.afd import nixl_device as nd

class Agent:
    def poll(self, who): pass
    def done(self, handle, who): return True
    def take_notes(self, peer, sid): return []

records = nd.HostWords(2 * nd.RING)
proxy = nd.Proxy(Agent(), records, nd.HostWords(nd.RING), nd.HostWords(2), 2, spin_s=0.0)
posted = []
proxy.serve(nd.Target("s1", "ffn-agent", lambda *w: posted.append(w) or object(), None,
                      print), "FFN rank 0")
records.words[0] = nd.record(0, 4096)
end = time.monotonic() + 10
while not posted and time.monotonic() < end:
    time.sleep(0.01)
print("posted", len(posted), flush=True)
# the process ends here: no session ends, the proxy is not stopped
"""


def test_the_proxy_reports_when_the_process_exits_with_its_session_open():
    """An engine ended by a signal closes no session: the proxy's last report comes at the
    process's exit, so that a run shorter than the report period still logs its figures."""
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                         env=child_env(), timeout=120)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "posted 1" in text, text
    assert "nixl proxy of FFN rank 0: 1 writes posted, 0 replies" in text, text


FORK_SCRIPT = """
import multiprocessing
import sys

def child():
    exec(sys.argv[1], {"__name__": "child"})  # EXIT_SCRIPT: one write posted, session open

ctx = multiprocessing.get_context("fork")
p = ctx.Process(target=child)
p.start()
p.join(60)
print("child exit", p.exitcode, flush=True)
"""


def test_the_proxy_reports_when_a_forked_child_exits_with_its_session_open():
    """A forked multiprocessing child (vLLM's engine core process) ends with os._exit,
    which runs no atexit hook: the proxy's last report still comes."""
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT, EXIT_SCRIPT], capture_output=True,
                         text=True, env=child_env(), timeout=120)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "posted 1" in text and "child exit 0" in text, text
    assert "nixl proxy of FFN rank 0: 1 writes posted, 0 replies" in text, text


def test_step_controls_are_sent_on_once_each_in_order(rig):
    _, proxy, _, controls, _, _ = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0")
    for k, (tokens, fl) in enumerate([(7, 0), (3, 0x200), (5, 0x201), (9, 0), (1, 0)]):
        controls.words[k % nd.RING] = nd.control_record(k, tokens, fl)
        wait_until(lambda k=k: len(s.controls) == k + 1, what=f"control {k}")
    assert s.controls == [(7, 0), (3, 0x200), (5, 0x201), (9, 0), (1, 0)]


def test_a_lost_reply_ends_the_session_by_name_and_releases_the_waits(rig):
    """The device's wait gave up on message 3 (its error word): the proxy reports the
    loss once, naming the peer, sets every flag so that other waits end now, and posts
    nothing more for that session."""
    _, proxy, records, _, flags, err = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0 at 10.0.0.2:9000")
    err.words[0] = 3
    wait_until(lambda: s.losses, what="the loss")
    assert "FFN rank 0 at 10.0.0.2:9000 did not answer" in s.losses[0]
    assert "layer message 3" in proxy.error
    assert all(flags.words == nd.POISON)
    ring(records, 0, 0, 64)
    time.sleep(0.05)
    assert s.writes == [] and len(s.losses) == 1


def test_a_failed_post_or_control_is_the_loss_of_the_peer(rig):
    _, proxy, records, controls, flags, _ = rig
    s = Session(fail_write=True)
    proxy.serve(s.target, "FFN rank 0")
    ring(records, 1, 0, 64)
    wait_until(lambda: s.losses, what="the loss")
    assert "UCX: endpoint closed" in s.losses[0] and all(flags.words == nd.POISON)
    c = Session(sid="s2", fail_control=True)
    records.zero()
    flags.zero()
    proxy.serve(c.target, "FFN rank 0")
    controls.words[0] = nd.control_record(0, 4, 0)
    wait_until(lambda: c.losses, what="the control's loss")
    assert "connection reset" in c.losses[0]


def test_release_then_a_new_session_starts_from_message_zero(rig):
    agent, proxy, records, _, flags, _ = rig
    s = Session()
    proxy.serve(s.target, "FFN rank 0")
    ring(records, 0, 0, 64)
    ring(records, 0, 1, 64)
    wait_until(lambda: len(s.writes) == 2, what="posts")
    proxy.release("lost AFD peer FFN rank 0: connection closed")
    assert all(flags.words == nd.POISON)  # a wait in flight ends now
    assert proxy.error.startswith("lost AFD peer")
    ring(records, 0, 2, 64)
    time.sleep(0.05)
    assert len(s.writes) == 2  # nothing posted for an ended session
    # the plane zeroes the rings and counters between forwards, then serves the new peer
    records.zero()
    flags.zero()
    t = Session(sid="s2", peer="ffn-agent-2")
    proxy.serve(t.target, "FFN rank 0")
    assert proxy.error is None
    ring(records, 0, 0, 32)
    wait_until(lambda: t.writes, what="the new session's post")
    assert t.writes == [(0, 0, 32, "s2:0:0")]
    agent.reply("ffn-agent-2", "s2", 0, 0)
    wait_until(lambda: flags.words[0] == 1, what="the new session's flag")


def test_stop_ends_the_thread_promptly():
    proxy = nd.Proxy(FakeAgent(), nd.HostWords(LANES * nd.RING), nd.HostWords(nd.RING),
                     nd.HostWords(LANES), LANES, spin_s=0.0)  # fmt: skip
    t0 = time.monotonic()
    proxy.stop()
    assert not proxy.running() and time.monotonic() - t0 < 1.0


def test_record_layouts_match_the_kernels():
    """The kernels pack records with literal shifts and a ring of 4; the host side reads
    them with these constants."""
    assert nd.RING == 4 and nd.STAMP_SHIFT == 40 and nd.CTRL_STAMP_SHIFT == 48
    assert nd.record(0, 4096) == (1 << 40) | 4096
    assert nd.control_record(0xFFFF, 5, 0x201) == (0x201 << 32) | 5  # the stamp wraps
