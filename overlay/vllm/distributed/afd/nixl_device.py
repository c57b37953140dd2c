# SPDX-License-Identifier: Apache-2.0
"""The device path of the NIXL data plane: CUDA graphs through a host proxy.

A NIXL transfer is posted by the host, so a captured CUDA graph cannot call it. On the
attention role the graph does only device work, and a proxy thread of the host posts:

* ``send``: a kernel copies the message into this lane's next registered VRAM send slot
  (slot = message number mod ``RING``), then ``ring`` bumps the lane's device counter and
  stores one 64-bit record into host-mapped (pinned) memory: the message number and its
  size. The proxy sees the record and posts the WRITE of that slot into the peer's inbox
  slot with the notification ``"<session>:<lane>:<seq>"``.
* ``recv``: the proxy takes the peer's notifications and advances the lane's reply flag
  (host-mapped memory) over the replies received in order; ``wait`` spins (volatile loads,
  bounded by ``timeout_ns`` on the GPU's clock: then the message number goes into the
  error word) until the flag passes its counter, and a copy takes the reply out of its
  inbox slot.
* ``control``: the step's control message (token count, micro-batch flags) is a record in
  a host-mapped ring too; the proxy sends it over the control channel.

Counters live on the device, so a replayed graph advances them as an eager step does, and
the records carry the message number, so the proxy never reads a stale one. A graph holds
only this side's own buffers: a restarted peer is met with a new session (the proxy's
target), the counters and rings zeroed between forwards, nothing captured again.

Everything here but the kernels is plain host code (the proxy's loop, the rings) and runs
on the CPU with DRAM buffers and host stores in place of the kernels (the unit tests).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import util as mp_util

import torch

from vllm.afd import roles
from vllm.logger import init_logger

try:  # triton ships with torch's CUDA builds
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer
except ImportError:  # pragma: no cover - the CPU path needs no kernel
    triton = None

# Send slots per lane (micro-batch); a lane has at most 2 messages (hidden states and router
# logits) ahead of its replies, so a slot is rewritten only after the peer took it.
RING = 4
# Record layout: message number + 1 (never 0: zeroed memory is "no record") in the bits
# above STAMP_SHIFT, the payload below.
STAMP_SHIFT = 40
PAYLOAD_MASK = (1 << STAMP_SHIFT) - 1
# A control record: stamp << 48 | flags << 32 | tokens.
CTRL_STAMP_SHIFT = 48
# Released waits read this (the peer is gone): every wait ends at once.
POISON = 1 << 62
COPY_BLOCK = 1024
# The proxy's timings kept for its summary (ProxyStats): the last this many of each.
STATS_KEEP = 4096
# The device waits' own durations (the wait kernel's clock) kept per lane: the last this
# many (the kernel indexes its ring by message number mod 64).
WAIT_KEEP = 64
# The proxy logs its summary at most this often while it serves (and when a session ends).
STATS_LOG_S = 30.0

logger = init_logger(__name__)

if triton is not None:

    @triton.jit
    def _copy_to_slot_kernel(src, base, ctr, slot_elems, n, BLOCK: tl.constexpr):
        c = tl.load(ctr)
        dst = base + (c % 4) * slot_elems  # RING
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(dst + i, tl.load(src + i, mask=m), mask=m)

    @triton.jit(do_not_specialize=["nbytes"])
    def _ring_kernel(ctr, records, nbytes):
        c = tl.load(ctr)
        tl.store(ctr, c + 1)
        tl.store(records + c % 4, ((c + 1) << 40) | nbytes.to(tl.int64))  # RING, STAMP_SHIFT

    @triton.jit(do_not_specialize=["tokens", "flags"])
    def _control_kernel(ctr, records, tokens, flags):
        c = tl.load(ctr)
        tl.store(ctr, c + 1)
        # the scalar arguments arrive as int32: widen them before shifting
        flags64 = flags.to(tl.int64) & 0xFFFF
        word = (((c + 1) & 0xFFFF) << 48) | (flags64 << 32) | tokens.to(tl.int64)
        tl.store(records + c % 4, word)  # RING

    @triton.jit(do_not_specialize=["timeout_ns"])
    def _wait_kernel(ctr, flag, err, waited, timeout_ns):
        c = tl.load(ctr) + 1
        t0 = globaltimer()
        v = tl.load(flag, volatile=True)
        waiting = v < c
        while waiting:
            v = tl.load(flag, volatile=True)
            waiting = (v < c) & ((globaltimer() - t0) < timeout_ns)
        if v < c:
            tl.store(err, c)  # the message this wait gave up on
        # how long it waited, + 1 (0 is "none"), in the lane's ring of WAIT_KEEP
        tl.store(waited + c % 64, globaltimer() - t0 + 1)
        tl.store(ctr, c)

    @triton.jit
    def _copy_from_slot_kernel(base, out, ctr, slot_elems, n, BLOCK: tl.constexpr):
        c = tl.load(ctr) - 1  # the wait advanced it
        src = base + (c % 4) * slot_elems  # RING
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out + i, tl.load(src + i, mask=m), mask=m)


class HostWords:
    """Pinned host memory that kernels read and write through its unified address: what a
    kernel stores there the host reads without a copy, and the other way round."""

    def __init__(self, n: int, device: torch.device | None = None):
        pin = device is not None and device.type == "cuda"
        self.tensor = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.words = self.tensor.numpy()  # the host's view (every read goes to memory)
        self.dtype = torch.int64

    def data_ptr(self) -> int:  # a kernel argument
        return self.tensor.data_ptr()

    def at(self, i: int) -> _Word:
        return _Word(self, i)

    def zero(self) -> None:
        self.words[:] = 0


@dataclass
class _Word:
    host: HostWords
    index: int

    @property
    def dtype(self):
        return torch.int64

    def data_ptr(self) -> int:
        return self.host.data_ptr() + 8 * self.index


def record(seq: int, payload: int) -> int:
    """The record of message ``seq`` (0-based) with ``payload`` (its size in bytes)."""
    return (seq + 1) << STAMP_SHIFT | payload


def control_record(seq: int, tokens: int, flags: int) -> int:
    return ((seq + 1) & 0xFFFF) << CTRL_STAMP_SHIFT | (flags & 0xFFFF) << 32 | tokens


def require_kernels() -> None:
    if triton is None:
        raise RuntimeError("the AFD nixl connector's device path needs triton")


class DeviceLanes:
    """The attention role's device state: per lane a send counter, a receive counter and
    the send records; the reply flags; the control ring; the error word. ``send``,
    ``recv`` and ``control`` issue device work on the current stream only."""

    def __init__(self, lanes: int, device: torch.device):
        require_kernels()
        self.lanes = lanes
        self.device = device
        # counters: [0, lanes) sent, [lanes, 2 lanes) received, 2 lanes: controls
        self.counters = torch.zeros(2 * lanes + 1, dtype=torch.int64, device=device)
        self.records = HostWords(lanes * RING, device)  # written by kernels, read by the proxy
        self.controls = HostWords(RING, device)
        self.flags = HostWords(lanes, device)  # written by the proxy, read by kernels
        self.err = HostWords(1, device)
        self.waited = HostWords(lanes * WAIT_KEEP, device)  # the waits' durations (ns + 1)

    def reset(self) -> None:
        """Between forwards (the device idle): a new session starts from message 0."""
        torch.cuda.synchronize(self.device)
        self.counters.zero_()
        torch.cuda.synchronize(self.device)
        self.records.zero()
        self.controls.zero()
        self.flags.zero()
        self.err.zero()
        # ``waited`` stays: the ended session's waits, which the proxy's report at the next
        # serve() takes (the counters from message 0 overwrite only what it took)

    def send(self, lane: int, x: torch.Tensor, outbox: torch.Tensor, slot_bytes: int) -> None:
        n = x.numel()
        size = x.element_size()
        base = outbox[lane * RING * slot_bytes:(lane + 1) * RING * slot_bytes].view(x.dtype)
        if n:
            grid = (triton.cdiv(n, COPY_BLOCK),)
            _copy_to_slot_kernel[grid](x, base, self.counters[lane:], slot_bytes // size, n,
                                       BLOCK=COPY_BLOCK)  # fmt: skip
        _ring_kernel[(1,)](self.counters[lane:], self.records.at(lane * RING), n * size,
                           num_warps=1)  # fmt: skip

    def recv(self, lane: int, out: torch.Tensor, inbox: torch.Tensor, slot_bytes: int,
             timeout_ns: int) -> None:  # fmt: skip
        ctr = self.counters[self.lanes + lane:]
        _wait_kernel[(1,)](ctr, self.flags.at(lane), self.err,
                           self.waited.at(lane * WAIT_KEEP), timeout_ns, num_warps=1)  # fmt: skip
        n = out.numel()
        if n:
            base = inbox[lane * RING * slot_bytes:(lane + 1) * RING * slot_bytes]
            base = base.view(out.dtype)
            grid = (triton.cdiv(n, COPY_BLOCK),)
            _copy_from_slot_kernel[grid](base, out, ctr, slot_bytes // out.element_size(), n,
                                         BLOCK=COPY_BLOCK)  # fmt: skip

    def control(self, tokens: int, flags: int) -> None:
        _control_kernel[(1,)](self.counters[2 * self.lanes:], self.controls, tokens, flags,
                              num_warps=1)  # fmt: skip

    def error_word(self) -> int:
        return int(self.err.words[0])

    def release(self) -> None:
        """Let every wait end now (the peer is gone; the pass's output is discarded)."""
        self.flags.words[:] = POISON


class Target:
    """Where the proxy posts for one session (set with the session, cleared with it)."""

    def __init__(self, sid: str, peer: str, write: Callable[[int, int, int, str], object],
                 control: Callable[[int, int], None] | None,
                 lost: Callable[[str], None]):  # fmt: skip
        self.sid = sid
        self.peer = peer  # the peer's agent name (its notifications)
        # write(lane, seq, nbytes, note) posts the WRITE of send slot seq % RING of
        # ``lane`` into the peer's inbox slot; returns a handle for the agent's ``done``.
        self.write = write
        # control(tokens, flags): the step's control message over the channel.
        self.control = control
        # lost(why): the session failed here (a post, a control, a wait that timed out).
        self.lost = lost


class ProxyStats:
    """Where a hand-over's time goes, per report: ``post`` (posting one write: a kept
    request posted again, or a new one made and posted), ``poll`` (one round of taking the
    peer's notifications), ``turn`` (from a lane's last write posted to the reply that
    answers it: the peer's share of a hand-over - its wait for the bytes, its FFN layer,
    its reply write - and the notification's way back), and ``wait`` (the device's: how
    long the graph's wait for a reply spun, on the GPU's clock). ``wait`` less ``turn`` is
    the proxy's own share: its wake-up on the doorbell, its post, and the reply flag's way
    to the device; the two medians are taken over the same last writes (the waits kept are
    the last WAIT_KEEP a lane). Seconds; the last STATS_KEEP of each."""

    def __init__(self):
        self.post: deque[float] = deque(maxlen=STATS_KEEP)
        self.poll: deque[float] = deque(maxlen=STATS_KEEP)
        self.turn: deque[float] = deque(maxlen=STATS_KEEP)
        self.wait: list[float] = []
        self.posts = self.replies = 0

    def take_waits(self, waited: HostWords) -> None:
        """The device waits' durations stored since the last take (then cleared)."""
        w = waited.words
        got = w[w > 0]
        w[:] = 0
        self.wait.extend(float(v - 1) * 1e-9 for v in got)

    def summary(self) -> dict[str, float]:
        """Medians in microseconds (0 where none was taken) and the counts;
        ``turn_waited_us``: the turn's median over as many of the last replies as there
        are device waits (the waits kept are the last ones), the turn to set against
        ``wait_us``."""
        out: dict[str, float] = {"posts": self.posts, "replies": self.replies}
        for name in ("post", "poll", "turn", "wait"):
            d = getattr(self, name)
            out[f"{name}_us"] = statistics.median(d) * 1e6 if d else 0.0
        last = list(self.turn)[-len(self.wait):] if self.wait else []
        out["turn_waited_us"] = statistics.median(last) * 1e6 if last else out["turn_us"]
        return out

    def line(self) -> str:
        m = self.summary()
        text = (f"{m['posts']:.0f} writes posted, {m['replies']:.0f} replies; median "
                f"post {m['post_us']:.1f} us, notification poll {m['poll_us']:.1f} us, "
                f"turn (last write posted to its reply) {m['turn_us']:.1f} us")
        if self.wait:
            text += (f", device wait for a reply {m['wait_us']:.1f} us (the last "
                     f"{len(self.wait)}; less their turn, {m['turn_waited_us']:.1f} us: "
                     f"{m['wait_us'] - m['turn_waited_us']:.1f} us of wake-up, post and flag)")
        return text


class Proxy:
    """The attention role's host proxy: posts what the device rang, turns the peer's
    notifications into reply flags, and reports a wait that gave up (the error word).
    One thread; ``agent`` is the plane's NIXL agent (``poll``, ``take_notes``, ``done``).
    ``stats``: where the time of the session it serves went since the last report
    (ProxyStats; ``waited``: the device waits' durations), reported (logged, then counted
    anew) when the session ends or another is served, every STATS_LOG_S while it serves,
    and once more when the process exits (an engine ended by a signal closes no
    session)."""

    def __init__(self, agent, records: HostWords, controls: HostWords, flags: HostWords,
                 lanes: int, spin_s: float, err: HostWords | None = None,
                 waited: HostWords | None = None,
                 name: str = "afd-nixl-proxy"):  # fmt: skip
        self.agent = agent
        self.records, self.controls, self.flags, self.err = records, controls, flags, err
        self.waited = waited
        self.lanes = lanes
        self.spin_s = spin_s
        self._lock = threading.Lock()
        self._target: Target | None = None
        self._who = ""
        self.error: str | None = None  # why the session failed (None: healthy)
        self._stop = threading.Event()
        self._reset_counts()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # At the process's exit: multiprocessing's exit hook runs in the main process (at
        # atexit) and in a multiprocessing child, forked ones included (which end with
        # os._exit and run no atexit hook): an engine core is one.
        self._at_exit = mp_util.Finalize(None, self._report_at_exit,
                                         exitpriority=roles.EXIT_PLANE_REPORT)

    def _report_at_exit(self) -> None:
        """The last report, unless the lock is not free within a second (never block the
        process's exit)."""
        if self._lock.acquire(timeout=1.0):
            try:
                self._report()
            finally:
                self._lock.release()

    def _reset_counts(self) -> None:
        self.posted = [0] * self.lanes
        self.replies = [0] * self.lanes
        self.controls_sent = 0
        self.stats = ProxyStats()
        self._last_post = [0.0] * self.lanes  # when the lane's last write was posted
        self._answered = [True] * self.lanes  # its last write was answered
        self._logged_at = time.monotonic()
        self._pending: list[object] = []
        self._early: list[set[int]] = [set() for _ in range(self.lanes)]
        self._through = False  # a reply taken in this session (logged once)

    # -- the session (from the plane, between forwards) --------------------------------
    def serve(self, target: Target, who: str) -> None:
        """Serve ``target`` from message 0 (the rings and counters were zeroed)."""
        with self._lock:
            self._report()
            self._reset_counts()
            self._target, self._who, self.error = target, who, None

    def release(self, why: str | None) -> None:
        """The session ended: post nothing more for it; device waits end at once."""
        with self._lock:
            self._report()
            self._target = None
            if why is not None and self.error is None:
                self.error = why
            self.flags.words[:] = POISON

    def report(self) -> None:
        """Log where the time went since the last report (the device waits' durations
        taken in), and count anew."""
        with self._lock:
            self._report()

    def take_stats(self) -> ProxyStats:
        """Where the time went since the last report or take (the device waits' durations
        taken in); counted anew from here."""
        with self._lock:
            return self._take_stats()

    def _take_stats(self) -> ProxyStats:
        stats, self.stats = self.stats, ProxyStats()
        if self.waited is not None:
            stats.take_waits(self.waited)
        return stats

    def _report(self) -> None:
        """Under the lock: the summary since the last report (when anything moved)."""
        if self._target is not None and self.stats.posts:
            logger.info("AFD: nixl proxy of %s: %s", self._who, self._take_stats().line())
        self._logged_at = time.monotonic()

    def stop(self) -> None:
        self._at_exit.cancel()
        self._stop.set()
        self._thread.join(5.0)

    def running(self) -> bool:
        return self._thread.is_alive()

    # -- the loop ---------------------------------------------------------------------
    def _run(self) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            busy, failed, controls = False, None, []
            with self._lock:
                t = self._target
                if t is not None and self.error is None:
                    try:
                        busy = self._pump(t, controls)
                    except Exception as e:  # noqa: BLE001 - any failure ends the session
                        failed = self._fail(t, str(e))
            if t is not None and failed is None:
                # Outside the lock: the channel's send takes the channel's lock, which is
                # held around release() (lock order: channel, then proxy).
                for tokens, flags in controls:
                    try:
                        t.control(tokens, flags)
                    except Exception as e:  # noqa: BLE001
                        with self._lock:
                            failed = self._fail(t, str(e))
                        break
            if failed is not None:
                t.lost(failed)
            now = time.monotonic()
            if busy:
                idle_since = now
                if now - self._logged_at > STATS_LOG_S:
                    self.report()
            elif now - idle_since > self.spin_s:
                time.sleep(0.0002 if t is not None else 0.01)

    def _fail(self, t: Target, why: str) -> str | None:
        """Under the lock: the session of ``t`` failed (once); its waits end now."""
        if self._target is not t or self.error is not None:
            return None
        self.error = why
        self._target = None
        self.flags.words[:] = POISON
        return why

    def _pump(self, t: Target, controls: list[tuple[int, int]]) -> bool:
        """One round: controls (collected), sends, completions, replies, the error word.
        True when anything moved."""
        busy = False
        words = self.controls.words
        while True:
            k = self.controls_sent
            word = int(words[k % RING])
            if word >> CTRL_STAMP_SHIFT != (k + 1) & 0xFFFF:
                break
            controls.append((word & 0xFFFFFFFF, (word >> 32) & 0xFFFF))
            self.controls_sent += 1
            busy = True
        recs = self.records.words
        for lane in range(self.lanes):
            while True:
                seq = self.posted[lane]
                word = int(recs[lane * RING + seq % RING])
                if word >> STAMP_SHIFT != seq + 1:
                    break
                t0 = time.perf_counter()
                self._pending.append(t.write(lane, seq, word & PAYLOAD_MASK,
                                             f"{t.sid}:{lane}:{seq}"))  # fmt: skip
                t1 = time.perf_counter()
                self.stats.post.append(t1 - t0)
                self.stats.posts += 1
                self._last_post[lane], self._answered[lane] = t1, False
                self.posted[lane] += 1
                busy = True
        if self._pending:
            self._pending = [h for h in self._pending if not self.agent.done(h, self._who)]
        t0 = time.perf_counter()
        self.agent.poll(self._who)
        notes = self.agent.take_notes(t.peer, t.sid)
        t1 = time.perf_counter()
        if notes:
            self.stats.poll.append(t1 - t0)
        for lane, seq in notes:
            if 0 <= lane < self.lanes:
                self._early[lane].add(seq)
        for lane in range(self.lanes):
            got, n = self._early[lane], self.replies[lane]
            if n in got:
                while n in got:
                    got.discard(n)
                    n += 1
                self.replies[lane] = n
                self.flags.words[lane] = n
                self.stats.replies += 1
                if not self._answered[lane]:
                    self._answered[lane] = True
                    self.stats.turn.append(t1 - self._last_post[lane])
                busy = True
                if not self._through:
                    self._through = True
                    logger.info("AFD: nixl proxy: %s answers (the first reply taken after %d "
                                "step control(s) and %d write(s) posted)", self._who,
                                self.controls_sent, sum(self.posted))  # fmt: skip
        if self.err is not None and int(self.err.words[0]):
            raise RuntimeError(
                f"AFD peer {self._who} did not answer within the timeout (layer message "
                f"{int(self.err.words[0])}, nixl)"
            )
        return busy
