# SPDX-License-Identifier: Apache-2.0
"""The AFD control channel, and the ``gloo`` connector (alias ``tcp``): the channel with
the socket data plane.

The channel: plain sockets rather than a torch Gloo process group: every read has a
deadline, a dead peer shows up as EOF/reset at once, sizes are bounded, and a stranger on
the port is dropped without touching the running deployment. The framing lives in
``vllm.distributed.afd.channel``; the handshake (hello, optional challenge-response
authentication, fingerprint), sessions, step ids, heartbeats, rejoin and failover are here.
How a layer's activations move is the data plane's (``vllm.distributed.afd.plane``):
:class:`TCPAttentionConnector` and :class:`TCPFFNConnector` take one (the socket plane by
default); the registry composes them with the plane its spec record names.

Rank layout: FFN rank ``f`` is reached at ``ffn_addresses[f]`` (default ``host:port+f``) and
serves attention ranks ``f*k .. f*k+k-1`` with ``k = num_attention_ranks / num_ffn_ranks``.
With ``connector_extra_config.ffn_failover`` (FFN replicas, each holding every
expert) an FFN rank also serves, as a guest, an attention rank of another replica
whose hello says it fails over here, until that rank goes back home.

Every connector is this channel composed with a data plane (``channel_connectors``):
``gloo`` (sockets), ``nixl``, ``cuda_ipc`` and ``nccl``; none subclasses the channel to
change it. What a plane of device work needs of the channel (its buffers or communicator
set up over the handshaken connection, the step's control as device work, a watchdog of
device waits, the FFN side's polling of device flags, its waits released when a session
fails) are the plane's documented hooks (``vllm.distributed.afd.plane``). The channel's
underscore members are its own: nothing outside this module uses them, except the
watchdog's probe (``_probe``, ``_watchdog``, ``_hold``) and the FFN side's device polling
(``_device_ready``, ``_check_sockets``, ``_poll_pause``) that the cuda_ipc unit tests
drive directly.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import torch

from vllm.afd import failure, metrics
from vllm.afd.protocol import (
    AUTH_NONE,
    AUTH_REQUIRED,
    MSG_GOODBYE,
    MSG_HEARTBEAT,
    MSG_PROFILE,
    MSG_STEP,
    PROTOCOL_VERSION,
    STATUS_BUSY,
    STATUS_CHALLENGE,
    STATUS_OK,
    AFDHandshakeError,
    AFDPeerError,
    AFDProtocolError,
    Control,
    LogThrottle,
    auth_proof,
    fingerprint_mismatch,
    is_nonce,
    new_nonce,
    pack_hello,
    printable,
    proof_matches,
    shown,
    ubatch_flags,
    ubatch_of,
)
from vllm.config.afd import join_address
from vllm.distributed.afd.base import (
    AttentionConnector,
    ConnectorContext,
    FFNConnector,
    StepPeer,
    register_connector,
)
from vllm.distributed.afd.channel import (
    Inbound,
    Peer,
    poll_io,
    recv_hello,
    recv_some,
    send_all,
    send_hello,
    send_some,
    socket_lost,
    tensor_bytes,
)
from vllm.distributed.afd.plane import (
    AttentionPlane,
    FFNPlane,
    Link,
    SocketAttentionPlane,
    SocketFFNPlane,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# The FFN's answer to a hello with a secret on its side only.
AUTH_MISSING = (
    "authentication failed (this FFN server requires a shared secret; the attention "
    "rank offered none)"
)
AUTH_DIFFERS = "authentication failed (shared secret differs)"


def shared_secret(ctx: ConnectorContext) -> tuple[str, str | None]:
    """(name of the variable, its value or None when unset or empty)."""
    env = ctx.config.connector_extra_config.get("secret_env", "VLLM_AFD_SECRET")
    return env, os.environ.get(env) or None


def _self_connected(sock: socket.socket) -> bool:
    """A TCP simultaneous open with itself: source address == destination address."""
    try:
        return sock.getsockname() == sock.getpeername()
    except OSError:
        return False


def ephemeral_port_range() -> tuple[int, int] | None:
    """This host's ephemeral port range (Linux), None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return lo, hi


def _hello_payload(ctx: ConnectorContext, role: str) -> dict:
    payload = dict(ctx.fingerprint)
    payload["role"] = role
    payload["rank"] = ctx.rank
    return payload


# Dialling the FFN rank: first retry after this many seconds, doubling up to the
# second value. At start-up a fixed short interval (both servers come up together);
# after a lost FFN rank a backoff (it restarts in seconds to minutes).
DIAL_RETRY_S = (0.2, 0.2)
# The FFN's refusal of a rank it still holds a connection of (the attention side
# retries it like "busy").
ALREADY_CONNECTED = " is already connected"
REJOIN_BACKOFF_S = (0.1, 1.0)
# Failover (connector_extra_config.ffn_failover): how long one replica is tried in a
# round, and how often a rank served by another replica tries its own again.
FAILOVER_TRY_S = 0.5
REBALANCE_S = 1.0
# A home FFN rank that refuses this rank at the re-handshake (another checkpoint,
# revision, topology or secret) is tried again after twice the last wait, up to this.
REBALANCE_MAX_S = 60.0
# The hello field of an attention rank that dials a replica other than its home
# FFN rank (failover): that replica takes it as a guest when it has ffn_failover.
HELLO_FAILOVER = "failover"


class _Busy(Exception):
    """The FFN rank had too many handshakes in progress: try again."""


class TCPAttentionConnector(AttentionConnector):
    """The control channel's attention side composed with a data plane (``plane``; by
    default the socket plane, connector ``gloo``)."""

    dbo_capable = True

    def __init__(self, ctx: ConnectorContext, plane: AttentionPlane | None = None):
        super().__init__(ctx)
        if plane is not None:  # the plane's declared capabilities are the connector's
            self.graph_capable = plane.graph_capable
            self.dbo_capable = plane.dbo_capable
        self.plane = plane if plane is not None else SocketAttentionPlane(ctx)
        # A plane of device work (nixl on CUDA, cuda_ipc with ipc_rejoin): a lost FFN rank
        # is rejoined by re-running the forward whole (vllm.afd.rejoin.run_forward), only
        # on the forward's thread.
        self.reruns_forward = self.plane.reruns_forward
        checks = self.plane.checks_every_forward
        self.checks_every_forward = self.plane.reruns_forward if checks is None else checks
        # A device session (AttentionPlane.device_session): its watchdog thread, and a
        # loss it holds for run_forward (``_hold``).
        self._watch: threading.Thread | None = None
        self._held = False
        # The lane (micro-batch) of this thread's messages, set by its begin_step.
        self._lanes = threading.local()
        self._control_step = 0  # step ids of the control messages the plane sends on
        cfg = ctx.config
        # The FFN rank that serves this rank (its home); after a loss, with
        # connector_extra_config.ffn_failover, another replica may serve it meanwhile.
        self.home = cfg.ffn_rank_of(ctx.rank)
        self._aim(self.home)
        self.timeout = float(cfg.timeout_s)
        self.secret_env, self.secret = shared_secret(ctx)
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._in_step = False
        # The open step: (step id, next micro-batch index, micro-batch count; 0
        # when not micro-batched), None between steps.
        self._step: tuple[int, int, int] | None = None
        self._dead: str | None = None
        self._closed = threading.Event()
        self._hb: threading.Thread | None = None
        # Rejoin (reconnect): one at a time; when the FFN rank was lost.
        self._rejoin_lock = threading.Lock()
        self._lost_at: float | None = None
        self._next_home_try = 0.0  # failover: when to try the home FFN rank again
        self._home_wait = REBALANCE_S  # and how long after a try (longer once refused)
        self._home_refusal: str | None = None  # the home rank's refusal, logged once
        # The rejoin window (rejoin_timeout_s) passed while idle: why (the reconnect's
        # error); every later reconnect fails at once with it.
        self._gave_up: str | None = None
        # Called (heartbeat thread) with the named error once the rejoin window passed
        # while idle; the attention role sets it to end the process (vllm.afd.failure
        # exit_now), as a lost FFN rank ends the engine when no step is there to fail.
        self.on_failure: Callable[[str], None] = lambda msg: None
        if self.plane.device_session:
            # The watchdog ends the process on a loss by default (the GPU stream may be
            # stuck behind a device wait); tests replace it.
            self.on_failure = failure.exit_now

    # -- connection ------------------------------------------------------
    def connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        logger.info("AFD: connecting to %s (timeout %.0f s)", self.peer, self.timeout)
        self._log_auth()
        sock, offer = self._establish(deadline, DIAL_RETRY_S, rejoining=False)
        with self._lock:
            self._attach(sock, offer)
        self._hb = threading.Thread(target=self._heartbeat_loop, name="afd-heartbeat", daemon=True)
        self._hb.start()
        if self.plane.device_session:
            self._watch = threading.Thread(target=self._watchdog, name="afd-watch", daemon=True)
            self._watch.start()
        logger.info("AFD: attention rank %d connected to %s", self.ctx.rank, self.peer)

    def _establish(
        self, deadline: float, backoff: tuple[float, float], rejoining: bool
    ) -> tuple[socket.socket, object]:
        """A handshaken connection to the FFN rank before ``deadline``, and the data
        plane's offer for it (``AttentionPlane.connect``; taken by ``_attach``): dials
        again while nothing listens (every ``backoff[0]`` s, doubling up to
        ``backoff[1]``) and while the FFN rank is busy (``rejoining``: also while it still
        holds this rank's previous connection)."""
        while True:
            sock = self._dial(deadline, backoff)
            try:
                self._handshake(sock, deadline, rejoining)
                return sock, self.plane.connect(self._link(sock), deadline)
            except AFDPeerError:
                # Rejoining, a reset or EOF in the handshake is an FFN server dying or
                # starting (its listener up before it serves): dial again.
                sock.close()
                if not rejoining or time.monotonic() >= deadline:
                    raise
                time.sleep(max(0.0, min(backoff[1], deadline - time.monotonic())))
            except _Busy as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise AFDPeerError(
                        f"AFD {self.peer} stayed busy for timeout_s={self.timeout:g}: {e}. "
                        "Is something flooding its AFD port?"
                    ) from None
                time.sleep(0.2)
            except BaseException:
                sock.close()
                raise

    def _link(self, sock: socket.socket) -> Link:
        return Link(sock, self.peer, self.timeout, self.ctx.rank, self.ffn_rank,
                    control=lambda n, flags: self._send_control(sock, n, flags),
                    lost=self._plane_lost)  # fmt: skip

    def _send_control(self, sock: socket.socket, num_tokens: int, flags: int) -> None:
        """A step's control message that the plane sends on (``carries_control``), on the
        session's own connection only."""
        with self._lock:
            if self.sock is not sock or self._dead is not None:
                raise AFDPeerError(f"AFD session with {self.peer} ended")
            if not ubatch_of(flags)[0]:
                self._control_step += 1
            send_all(sock, Control(MSG_STEP, self._control_step, num_tokens, flags).pack(),
                     self.timeout, self.peer)  # fmt: skip

    def _plane_lost(self, why: str) -> None:
        """The plane found the session failed (a device wait that timed out, a transfer
        that failed): the FFN rank is lost as if its connection had closed, and the
        connection is shut down (the FFN rank ends the session at once)."""
        with self._lock:
            self._fail(AFDPeerError(why), "the data plane")

    # -- forwards re-run whole (planes with reruns_forward) ----------------------------
    @property
    def can_rejoin(self) -> bool:
        """The layer-level rejoin of vllm.afd.rejoin; with ``reruns_forward`` only where
        losses are held (a forward is then re-run whole instead); never where the plane
        cannot rejoin (``AttentionPlane.rejoins``)."""
        if not self.plane.rejoins:
            return False
        return self.holds_losses() if self.reruns_forward else True

    def holds_losses(self) -> bool:
        """A loss is held for a re-run of the forward (not fatal): the plane re-runs
        forwards and can rejoin, the window is not 0, and the forwards run under
        run_forward (which checks each one before its output is used)."""
        return (self.reruns_forward and self.forwards_guarded and self.plane.rejoins
                and self.ctx.config.rejoin_window_s > 0)  # fmt: skip

    def step_lost(self) -> str | None:
        """After a forward (its device work waited for): why the FFN rank was lost during
        it (the channel's loss, or the plane's: a wait that timed out), None when clean."""
        lost = self.plane.step_lost()
        if lost is not None and self.plane.device_session:
            if self._dead is None:
                self._hold(lost)
        elif lost is not None:
            with self._lock:
                self._fail(AFDPeerError(lost), "the data plane")
        return self._dead

    def _attach(self, sock: socket.socket, offer: object) -> None:
        """Take ``sock`` (handshaken, the plane's ``offer`` made on it) as the session,
        under the lock."""
        self.plane.attach(self._link(sock), offer)
        self.sock = sock

    # -- rejoin: the FFN rank was lost and may come back --------------------
    def lost_at(self) -> float | None:
        """time.monotonic() when this rank noticed the loss of its FFN rank (None
        while connected, or before the first connection)."""
        return self._lost_at

    def reconnect(self, deadline: float) -> None:
        """Reach the FFN rank again (the same address), re-handshake and take the
        new connection, retrying with backoff until ``deadline``. A no-op while the
        connection is up. Raises AFDPeerError at the deadline, and at once an
        AFDHandshakeError when what answers is not of this deployment (fingerprint,
        revision, topology or authentication differ)."""
        with self._rejoin_lock:
            if self.is_up():
                return
            if self._gave_up is not None:  # the window passed while idle (the engine ends)
                raise AFDPeerError(self._gave_up)
            if self._lost_at is None:
                self._lost_at = time.monotonic()
            self._drop_connection()
            if len(self._replicas()) > 1:
                sock, offer = self._establish_any(deadline)
            else:
                sock, offer = self._establish(deadline, REJOIN_BACKOFF_S, rejoining=True)
            with self._lock:
                # close() sets _closed, then takes the lock: checked here, under it, so
                # that a close() meanwhile never leaves this closed connector a session
                if self._closed.is_set():  # closed meanwhile (the engine stops)
                    self.plane.discard(offer)
                    sock.close()
                    raise AFDPeerError(f"AFD attention rank closed while rejoining {self.peer}")
                self._attach(sock, offer)
                self._step = None
                self._in_step = False
                self._dead = None
                self._held = False  # a device session's watchdog watches again
                outage = time.monotonic() - self._lost_at
                self._lost_at = None
            metrics.STATS.record({"rejoins": 1, "outage_seconds": outage})
            logger.warning(
                "AFD: attention rank %d rejoined %s after %.2f s without it",
                self.ctx.rank, self.peer, outage,
            )  # fmt: skip

    # -- failover between FFN replicas (connector_extra_config.ffn_failover) --
    def _aim(self, ffn_rank: int) -> None:
        """Dial FFN rank ``ffn_rank`` from now on (its address, its name in messages)."""
        cfg = self.ctx.config
        self.ffn_rank = ffn_rank
        self.addr = cfg.ffn_address(ffn_rank)
        self.peer = f"FFN rank {ffn_rank} at {cfg.ffn_address_text(ffn_rank)}"

    def _dialer(self, ffn_rank: int) -> TCPAttentionConnector:
        """A shallow copy of this connector aimed at FFN rank ``ffn_rank``: it dials and
        handshakes there while this one keeps naming (and serving through) the FFN rank
        of its live connection (vllm:afd_peer_up's label, error messages)."""
        other = copy.copy(self)
        other._aim(ffn_rank)
        return other

    def _replicas(self) -> list[int]:
        """The FFN ranks a rejoin tries, in order: the home rank, then (with
        ffn_failover, num_ffn_ranks > 1: every FFN rank holds all the experts)
        the other replicas."""
        cfg = self.ctx.config
        n = cfg.num_ffn_ranks
        if n == 1 or not cfg.connector_extra_config.get("ffn_failover", False):
            return [self.home]
        return [(self.home + i) % n for i in range(n)]

    def _establish_any(self, deadline: float) -> tuple[socket.socket, object]:
        """A handshaken connection to the first replica that takes this rank, in
        rounds over _replicas() (a short try each) until ``deadline``. A replica
        that refuses the rank (it does not serve guests) is passed over; the home
        rank of another deployment fails at once."""
        wait = REJOIN_BACKOFF_S[0]
        last: Exception | None = None
        while True:
            for f in self._replicas():
                self._aim(f)
                try_until = min(deadline, time.monotonic() + FAILOVER_TRY_S)
                try:
                    return self._establish(try_until, (FAILOVER_TRY_S,) * 2, rejoining=True)
                except AFDHandshakeError as e:
                    if f == self.home:
                        raise
                    last = e
                except AFDPeerError as e:
                    last = e
            self._aim(self.home)
            if time.monotonic() >= deadline:
                raise AFDPeerError(
                    f"no AFD FFN replica of {self.peer} took this rank by the deadline: {last}"
                )
            time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(REJOIN_BACKOFF_S[1], 2 * wait)

    def _rebalance(self) -> None:
        """Served by another replica (failover): between steps, try the home FFN
        rank and move back to it once it takes this rank again."""
        now = time.monotonic()
        if self.ffn_rank == self.home or now < self._next_home_try or self.reruns_forward:
            # (a plane of device work moves only between forwards, on their thread)
            return
        self._next_home_try = now + self._home_wait
        with self._rejoin_lock:
            guest_peer = self.peer
            home = self._dialer(self.home)
            try:
                sock, offer = home._establish(now + FAILOVER_TRY_S, (1.0, 1.0), rejoining=True)
            except AFDHandshakeError as e:
                self._home_refused(home.peer, e)
                return
            except AFDPeerError:
                return
            with self._lock:
                moved = not (self._in_step or self._dead or self._closed.is_set())
                if moved:
                    old = self.sock
                    with contextlib.suppress(AFDPeerError):
                        send_all(old, Control(MSG_GOODBYE).pack(), 2.0, guest_peer)
                    self.plane.detach()
                    self._aim(self.home)
                    self._attach(sock, offer)
            if not moved:  # a step began meanwhile (try again later), or closed
                self.plane.discard(offer)
                with contextlib.suppress(AFDPeerError):
                    send_all(sock, Control(MSG_GOODBYE).pack(), 2.0, home.peer)
                sock.close()
                return
        old.close()
        self._home_wait, self._home_refusal = REBALANCE_S, None
        logger.warning("AFD: attention rank %d moved back from %s to its own %s",
                       self.ctx.rank, guest_peer, self.peer)  # fmt: skip

    def _home_refused(self, home: str, e: AFDHandshakeError) -> None:
        """The home FFN rank answers but refuses this rank (another deployment came back
        there): counted (vllm:afd_home_refusals_total), logged once per reason, and
        tried again after a doubling wait (that rank logs each refused hello)."""
        metrics.STATS.inc("home_refusals")
        self._home_wait = min(REBALANCE_MAX_S, 2 * self._home_wait)
        self._next_home_try = time.monotonic() + self._home_wait
        if str(e) != self._home_refusal:
            self._home_refusal = str(e)
            logger.warning(
                "AFD: attention rank %d stays on %s: its own %s refused it (%s); trying it "
                "again in %.0f s, the wait doubling up to %.0f s",
                self.ctx.rank, self.peer, home, e, self._home_wait, REBALANCE_MAX_S,
            )  # fmt: skip

    def _drop_connection(self) -> None:
        """Close the lost connection and end its data-plane session."""
        with self._lock:
            sock, self.sock = self.sock, None
            self.plane.detach()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _rejoin_in_background(self) -> None:
        """The heartbeat noticed the loss between steps: reconnect now (within
        rejoin_timeout_s of the loss) so that a restarted FFN rank finds its
        attention rank at once; a step that comes meanwhile waits for this."""
        if self.reruns_forward:
            return  # only the forward's thread rejoins (run_forward), between forwards
        lost = self._lost_at
        window = self.ctx.config.rejoin_window_s
        if not self.can_rejoin or window <= 0 or lost is None or self._gave_up is not None:
            return
        try:
            self.reconnect(lost + window)
        except (AFDPeerError, AFDHandshakeError) as e:
            if not self._closed.is_set():  # not the engine stopping
                self._give_up(e, window)

    def _give_up(self, e: Exception, window: float) -> None:
        """The lost FFN rank did not come back within rejoin_timeout_s while no step ran
        (or what came back is of another deployment): nothing else would end the engine,
        which would wait (and /health answer "held until it rejoins") for good. Named as
        a held step names it (vllm.afd.rejoin), recorded for the clients' error, then
        on_failure."""
        self._gave_up = str(e)
        if isinstance(e, AFDHandshakeError):
            msg = f"{self._dead or 'lost AFD ' + self.peer}; what came back is refused: {e}"
        else:
            msg = (f"{self._dead or 'lost AFD ' + self.peer}; it did not come back within "
                   f"rejoin_timeout_s={window:g} ({e})")  # fmt: skip
        logger.error("AFD: attention rank %d gives up on %s, ending the engine: %s",
                     self.ctx.rank, self.peer, msg)  # fmt: skip
        failure.record("attention", self.ctx.rank, msg)
        self.on_failure(msg)

    def _log_auth(self) -> None:
        if self.secret:
            logger.info(
                "AFD: authentication required: attention rank %d and %s prove the shared "
                "secret in $%s to each other",
                self.ctx.rank,
                self.peer,
                self.secret_env,
            )
        else:
            logger.warning(
                "AFD: authentication off: $%s is not set, so attention rank %d cannot tell "
                "the FFN rank at %s from any process answering there (set the same secret "
                "on every server of the deployment)",
                self.secret_env,
                self.ctx.rank,
                join_address(*self.addr),
            )

    def _dial(self, deadline: float, backoff: tuple[float, float]) -> socket.socket:
        last_err: Exception | None = None
        wait = backoff[0]
        while True:
            try:
                left = max(0.05, deadline - time.monotonic())
                sock = socket.create_connection(self.addr, timeout=min(5.0, self.timeout, left))
                if _self_connected(sock):
                    # Nothing listens yet and the kernel picked the FFN's own port as
                    # this socket's source port (possible when that port lies in the
                    # ephemeral range): the socket is connected to itself and holds
                    # the port the FFN rank is about to bind. Free it and retry.
                    sock.close()
                    raise ConnectionRefusedError(
                        "connection to itself (nothing listening on the FFN port yet)"
                    )
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                last_err = e
                if time.monotonic() >= deadline:
                    raise AFDPeerError(
                        f"could not reach AFD {self.peer} within timeout_s={self.timeout:g}: "
                        f"{last_err}. Check that the FFN server is started with the same "
                        "--afd-config, that its address (ffn_addresses, or host/port) is "
                        "right and reachable from here."
                    ) from None
                time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
                wait = min(backoff[1], 2 * wait)

    def _handshake(self, sock: socket.socket, deadline: float, rejoining: bool = False) -> None:
        """Hello; with a shared secret a challenge-response round where both sides
        prove it over fresh nonces; then the FFN's verdict and fingerprint."""
        nonce = new_nonce()
        local = _hello_payload(self.ctx, "attention")
        local.update(nonce=nonce, auth=AUTH_REQUIRED if self.secret else AUTH_NONE)
        if self.ffn_rank != self.home:
            local[HELLO_FAILOVER] = True  # a guest there: its home FFN rank is away
        send_hello(sock, local, self.timeout, self.peer)
        # At start-up a hello gets 10 s even past the deadline; a rejoin keeps to it.
        hello_deadline = deadline if rejoining else max(deadline, time.monotonic() + 10.0)
        reply = self._recv_reply(sock, hello_deadline)
        self._check_auth_mode(reply)
        ffn_nonce = None
        if reply.get("status") == STATUS_CHALLENGE:
            ffn_nonce = reply.get("nonce")
            if not is_nonce(ffn_nonce):
                raise AFDHandshakeError(f"AFD {self.peer} sent a malformed challenge")
            proof = self._proof("attention", nonce, ffn_nonce)
            send_hello(sock, {"proof": proof}, self.timeout, self.peer)
            reply = self._recv_reply(sock, hello_deadline)
        status = reply.get("status")
        if rejoining and isinstance(status, str) and status.endswith(ALREADY_CONNECTED):
            # The FFN rank has not noticed yet that this rank's previous connection is
            # gone (a rejoin after a timeout): it drops that one within timeout_s.
            raise _Busy(f"{self.peer} still holds this rank's previous connection")
        if status != STATUS_OK:
            raise AFDHandshakeError(
                f"AFD {self.peer} refused this attention rank: {printable(status)}"
            )
        if self.secret and (
            ffn_nonce is None
            or not proof_matches(self._proof("ffn", nonce, ffn_nonce), reply.get("proof"))
        ):
            raise AFDHandshakeError(
                f"AFD {self.peer} did not prove the shared secret (${self.secret_env}): the "
                "FFN server has another secret, or something else answers on that address. "
                "Refusing to send it activations."
            )
        mismatch = fingerprint_mismatch(local, reply)
        if mismatch:
            raise AFDHandshakeError(f"{mismatch} ({self.peer})")

    def _recv_reply(self, sock: socket.socket, deadline: float) -> dict:
        try:
            return recv_hello(sock, deadline, self.peer)
        except AFDPeerError as e:
            raise AFDPeerError(
                f"{e} (during the AFD handshake, before any reply: is what listens there "
                "an AFD FFN server of this build?)"
            ) from None

    def _check_auth_mode(self, reply: dict) -> None:
        """Refuse an FFN of another protocol, a busy one (retried), and one whose
        authentication setting differs from this side's, in either direction."""
        status = reply.get("status")
        if reply.get("protocol") != PROTOCOL_VERSION:
            raise AFDHandshakeError(
                f"AFD fingerprint mismatch on 'protocol': this side has {PROTOCOL_VERSION}, "
                f"the peer has {shown(reply.get('protocol'))} ({self.peer}, which answered "
                f"{printable(status)})"
            )
        if status == STATUS_BUSY:
            raise _Busy(f"{self.peer} has too many handshakes in progress")
        required = reply.get("auth") == AUTH_REQUIRED
        if self.secret and not required:
            raise AFDHandshakeError(
                f"AFD {self.peer} does not require authentication (it has no shared secret) "
                f"but this attention rank has one (${self.secret_env} is set): set the same "
                f"{self.secret_env} on the FFN server, or unset it here"
            )
        if not self.secret and required:
            raise AFDHandshakeError(
                f"AFD {self.peer} requires authentication but this attention rank has no "
                f"shared secret: set {self.secret_env} on this server to the FFN server's value"
            )

    def _proof(self, prover: str, attention_nonce: str, ffn_nonce: str) -> str:
        assert self.secret
        return auth_proof(
            self.secret, prover, self.ctx.rank, self.ffn_rank, attention_nonce, ffn_nonce
        )

    def _heartbeat_loop(self) -> None:
        interval = min(1.0, self.timeout / 4)
        msg = Control(MSG_HEARTBEAT).pack()
        while not self._closed.wait(interval):
            with self._lock:
                if self._in_step:
                    continue
                lost = self._dead is not None or self.sock is None
                if not lost:
                    try:
                        send_all(self.sock, msg, self.timeout, self.peer)
                    except AFDPeerError as e:
                        self._note_lost(str(e))
                        lost = True
            if lost:
                self._rejoin_in_background()
            else:
                self._rebalance()

    def _check(self) -> socket.socket:
        if self._dead:
            raise AFDPeerError(self._dead)
        if self.sock is None:
            raise AFDPeerError(f"AFD attention rank is not connected to {self.peer}")
        return self.sock

    # -- a failure part-way through a step ------------------------------------
    @contextlib.contextmanager
    def _fatal(self, what: str) -> Iterator[None]:
        """Any exception here leaves the byte stream at an unknown point of the
        step (data frames carry no step id): the connection is dead for good."""
        try:
            yield
        except BaseException as e:
            self._fail(e, what)
            raise

    def _note_lost(self, why: str) -> None:
        # lost_at first: a reader that sees is_up() False then finds when (the rejoin
        # window counts from it; another thread may read the two in between)
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        if self._dead is None:
            self._dead = why
            logger.error("AFD: %s", why)
            self.plane.lost(why)  # device waits on the peer end now
            if (self.plane.reruns_forward and not self.plane.device_session
                    and not self.holds_losses()):  # fmt: skip
                # A pass of device work cannot fail part-way: without a held re-run the
                # engine ends (as a lost peer without rejoin does), naming the loss.
                failure.record("attention", self.ctx.rank, why)
                self.on_failure(why)

    def _fail(self, e: BaseException, what: str) -> None:
        if self._dead is None:
            self._note_lost(
                str(e)
                if isinstance(e, AFDPeerError)
                else (
                    f"AFD step with {self.peer} failed part-way in {what} "
                    f"({type(e).__name__}: {e}); the connection is out of step and closed"
                )
            )
        sock = self.sock
        if sock is not None:
            try:  # the FFN rank sees EOF at once instead of waiting for the rest
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- per step ----------------------------------------------------------
    def begin_step(
        self,
        step_id: int,
        num_tokens: int,
        ubatch: tuple[int, int] | None = None,
        ubatch_tokens: list[int] | None = None,
    ) -> None:
        """``ubatch``: (index, count) when this opens one micro-batch of a DBO step
        (every micro-batch sends its own control message here, so the token
        counts of the others, ``ubatch_tokens``, are not needed). Refused while
        another step is open (end_step not called: a step failed part-way)."""
        self._lanes.lane = ubatch[0] if ubatch is not None else 0
        if self.plane.device_session:  # the plane orders its steps on the device
            self._check()
            self.plane.open_step(num_tokens, ubatch, ubatch_tokens)
            return
        if self.plane.carries_control:  # device work, sent on by the plane
            self._check()
            flags = ubatch_flags(*ubatch) if ubatch is not None else 0
            with self._lock:
                self._open(step_id, ubatch)
            self.plane.open_step(num_tokens, ubatch, ubatch_tokens)
            return
        with self._lock:
            sock = self._check()
            with self._fatal("begin_step"):
                flags = ubatch_flags(*ubatch) if ubatch is not None else 0
                self._open(step_id, ubatch)
                self._in_step = True
                send_all(sock, Control(MSG_STEP, step_id, num_tokens, flags).pack(),
                         self.timeout, self.peer)  # fmt: skip

    def _open(self, step_id: int, ubatch: tuple[int, int] | None) -> None:
        index, count = ubatch or (0, 0)
        if self._step is None and index == 0:
            self._step = (step_id, 1, count)
            return
        if self._step is not None and count and self._step == (step_id, index, count):
            self._step = (step_id, index + 1, count)
            return
        opened = f"step {step_id}" + (f" micro-batch {index} of {count}" if count else "")
        if self._step is None:
            raise AFDProtocolError(f"AFD: {opened} opened no step (micro-batch 0 comes first)")
        raise AFDProtocolError(
            f"AFD: {opened} begun while step {self._step[0]} is open (no end_step: did "
            "that step fail part-way?)"
        )

    def _lane(self) -> int:
        return getattr(self._lanes, "lane", 0)

    def send(self, x: torch.Tensor) -> None:
        if self.plane.device_session:
            self.plane.send(x, self._lane())
            return
        self._check()
        with self._fatal("send"):
            self.plane.send(x, self._lane())

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        if self.plane.device_session:
            return self.plane.recv(out, self._lane())
        self._check()
        with self._fatal("recv"):
            self.plane.recv(out, self._lane())
        return out

    def recv_start(self, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start receiving ``out`` in the background, after the receives started
        before it; the returned ``wait()`` gives it (bounded by timeout_s)."""
        if self.plane.device_session:
            return self.plane.recv_start(out, self._lane())
        self._check()
        with self._fatal("recv_start"):
            wait_plane = self.plane.recv_start(out, self._lane())

        def wait() -> torch.Tensor:
            try:
                return wait_plane()
            except BaseException as e:
                self._fail(e, "recv_start")
                raise

        return wait

    def end_step(self) -> None:
        if self.plane.device_session:
            return  # no open step on the host
        with self._lock:
            self._in_step = False
            self._step = None

    def is_up(self) -> bool:
        return self.sock is not None and not self._dead

    def shares_device(self) -> bool | None:
        return self.plane.shares_device()

    # -- the watchdog of a device session (AttentionPlane.device_session) -------------
    def _watchdog(self) -> None:
        """Every 0.1 s: the session's connection (EOF of a dead FFN rank is immediate)
        and the plane's device probe (a wait that gave up). A loss is held where losses
        are held (``_hold``: run_forward rejoins), else recorded for the engine-death
        message and the rank ended (``on_failure``)."""
        if self.ctx.device.type == "cuda":
            torch.accelerator.set_device_index(self.ctx.device.index or 0)
        while not self._closed.wait(0.1):
            if self._held:
                continue  # held: run_forward rejoins (see _hold)
            msg = self._dead
            if msg is None:
                try:
                    msg = self._probe()
                except Exception as e:  # noqa: BLE001 - a blind watchdog fails the rank
                    msg = (
                        f"AFD watchdog of the connection to {self.peer} failed "
                        f"({type(e).__name__}: {e}); this rank could no longer notice a "
                        "lost or silent FFN rank"
                    )
            if msg is not None and self.reruns_forward and self.holds_losses():
                self._hold(msg)
                continue
            if msg is not None:
                self._dead = msg
                logger.error("AFD: %s", msg)
                failure.record("attention", self.ctx.rank, msg)
                self.on_failure(msg)
                return

    def _probe(self) -> str | None:
        sock = self.sock
        if sock is None:
            return None
        lost = socket_lost(sock)
        if lost is not None:
            return None if self.sock is None else f"lost AFD peer {self.peer}: {lost}"
        return self.plane.probe()

    def _hold(self, msg: str) -> None:
        """The FFN rank is lost: note it (the forward's check sees it) and release this
        rank's own device waits (``AttentionPlane.hold``), so that a replay in flight
        ends now instead of after timeout_s; its output is discarded."""
        self._note_lost(msg)
        self._held = True
        self.plane.hold()

    def profile(self, is_start: bool) -> None:
        with self._lock:
            sock = self._check()
            with self._fatal("profile"):
                send_all(sock, Control(MSG_PROFILE, flags=int(is_start)).pack(),
                         self.timeout, self.peer)  # fmt: skip
        logger.info("AFD: asked %s to %s its profiler", self.peer, "start" if is_start else "stop")

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self.sock is not None:
                if not self._dead and not self._in_step:
                    try:
                        send_all(self.sock, Control(MSG_GOODBYE).pack(), 2.0, self.peer)
                    except AFDPeerError:
                        pass
                self.plane.detach()  # ends a background receive at once, not at its deadline
                self.sock.close()
                self.sock = None
            self.plane.close()


class TCPFFNConnector(FFNConnector):
    dbo_capable = True
    # A lost attention rank ends its own session only; the rank may connect again.
    survives_peer_loss = True
    # Receives and sends are posted and the sockets of all attention ranks pumped
    # together (post_recv, post_send, pump): no rank waits on another rank's bytes. With
    # a data plane of the channel's own connection (FFNPlane.in_channel: sockets), or of
    # one whose messages are posted and checked without waiting (FFNPlane.polled: nixl).
    async_io = True
    # A rank that had a step within ACTIVE_S is waited for (up to the batch
    # window, connector_extra_config.batch_window_ms, default 5) to join a step.
    ACTIVE_S = 1.0
    # Handshakes in progress at once; a connection beyond them is answered
    # "busy" and closed at once (an attention rank retries within timeout_s).
    MAX_HANDSHAKES = 32
    # accept() failing (EMFILE, ENFILE, ENOBUFS...): wait this long before the
    # next try, doubling up to the second value, instead of spinning.
    ACCEPT_BACKOFF_S = (0.1, 1.0)
    # Step control by the plane (FFNPlane.polls_steps): polls back to back for HOT_S
    # after a step, then every IDLE_POLL_S (with the plane's hot_poll).
    HOT_S = 0.5
    IDLE_POLL_S = 200e-6

    def __init__(self, ctx: ConnectorContext, plane: FFNPlane | None = None):
        super().__init__(ctx)
        if plane is not None:  # the plane's declared capabilities are the connector's
            self.graph_capable = plane.graph_capable
            self.dbo_capable = plane.dbo_capable
        self.plane = plane if plane is not None else SocketFFNPlane(ctx)
        self.async_io = type(self).async_io and (self.plane.in_channel or self.plane.polled)
        self._plane_moved = time.monotonic()  # a polled plane's last post or arrival
        self._unread: set[int] = set()  # ids of peers with bytes not yet wanted (_watch_eof)
        self.ubatch_controls_upfront = self.plane.ubatch_controls_upfront
        self.hot_poll = self.plane.hot_poll
        self._last_step = float("-inf")  # the last step the plane's poll found
        cfg = ctx.config
        self.batch_window = float(cfg.connector_extra_config.get("batch_window_ms", 5.0)) / 1e3
        self.expected = set(cfg.attention_ranks_of(ctx.rank))
        # ffn_failover: attention ranks of other replicas served while their home FFN
        # rank is away (guests: served like own ranks, not waited for at start).
        self.takes_guests = cfg.ffn_failover
        self.guests: set[int] = set()
        self.addr = cfg.ffn_listen_address(ctx.rank)
        self.timeout = float(cfg.timeout_s)
        self.secret_env, self.secret = shared_secret(ctx)
        self.listener: socket.socket | None = None
        self.peers: dict[int, Peer] = {}
        self._joining: set[int] = set()  # accepted ranks whose device channel is being set up
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started_at = 0.0
        self._ever_complete = False
        # connector_extra_config.ffn_elastic_attention: attention slots may stay empty (a
        # scaler starts their servers later): no start-up wait for all of them.
        self._elastic = cfg.connector_extra_config.get("ffn_elastic_attention", False) is True
        self._last_refusal: str | None = None  # named in the start-up timeout error
        self.lost: dict[int, str] = {}  # why each attention rank's last session ended
        self._accept_thread: threading.Thread | None = None
        self._profile_requests: list[bool] = []
        # Step-control messages read (their ranks held: see Peer.held) and not yet handed
        # out by wait_step; the serve thread's only.
        self._steps: list[StepPeer] = []
        self._handshakes = 0  # in progress (guarded by _hs_lock)
        self._hs_lock = threading.Lock()
        self._log_refused = LogThrottle()
        self._log_accept_error = LogThrottle()

    @property
    def generation(self) -> int:
        """Bumped by the plane whenever a session's device buffers are new (the FFN
        runner drops the CUDA graphs captured before)."""
        return self.plane.generation

    def start(self) -> None:
        self.plane.start()
        host, port = self.addr
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise AFDPeerError(f"AFD FFN rank cannot resolve host {host!r}: {e}") from e
        family, _, _, _, sockaddr = infos[0]
        lst = socket.socket(family, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lst.bind(sockaddr)
        except OSError as e:
            lst.close()
            raise AFDPeerError(
                f"AFD FFN rank {self.ctx.rank} cannot listen on {host}:{port}: {e}. "
                "Is another server using this port, or is the host not an address "
                "of this machine?"
            ) from e
        lst.listen(16)
        self.listener = lst
        self._warn_ephemeral(port)
        self._started_at = time.monotonic()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="afd-accept", daemon=True
        )
        self._accept_thread.start()
        logger.info(
            "AFD: FFN rank %d listening on %s:%d for attention ranks %s",
            self.ctx.rank,
            host,
            port,
            sorted(self.expected),
        )
        self._log_auth()

    def _warn_ephemeral(self, port: int) -> None:
        eph = ephemeral_port_range()
        if eph is not None and eph[0] <= port <= eph[1]:
            logger.warning(
                "AFD: FFN rank %d listens on port %d, inside this host's ephemeral port "
                "range %d-%d: the kernel may give this port to an outgoing connection or "
                "to another program's bind(0) while this server is down (a restart then "
                "fails with 'Address already in use', or an attention rank connects to "
                "the wrong listener). Choose a port below %d.",
                self.ctx.rank,
                port,
                eph[0],
                eph[1],
                eph[0],
            )

    def _log_auth(self) -> None:
        if self.secret:
            logger.info(
                "AFD: authentication required: FFN rank %d accepts only attention ranks "
                "that prove the shared secret in $%s (and proves it to them)",
                self.ctx.rank,
                self.secret_env,
            )
        else:
            logger.warning(
                "AFD: authentication off: $%s is not set, so FFN rank %d accepts any "
                "process that reaches %s:%d and sends a matching hello as an attention "
                "rank (set the same secret on every server of the deployment)",
                self.secret_env,
                self.ctx.rank,
                *self.addr,
            )

    # -- accepting ---------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self.listener is not None
        try:
            self.listener.settimeout(0.5)
        except OSError:  # closed before this thread ran
            return
        backoff = 0.0
        while not self._stop.is_set():
            try:
                sock, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                # Out of descriptors (EMFILE/ENFILE) or memory: the pending
                # connection stays queued and accept() fails again at once.
                lo, hi = self.ACCEPT_BACKOFF_S
                backoff = min(hi, max(lo, 2 * backoff))
                self._log_accept_error(
                    logger.error,
                    "AFD: FFN rank %d cannot accept connections on %s:%d: %s; next try in %.1f s",
                    self.ctx.rank,
                    *self.addr,
                    e,
                    backoff,
                )
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            self._start_handshake(sock, f"{addr[0]}:{addr[1]}")

    def _start_handshake(self, sock: socket.socket, addr: str) -> None:
        """Handshake in its own thread so that a silent stranger cannot hold up
        other peers; at most MAX_HANDSHAKES at once."""
        with self._hs_lock:
            busy = self._handshakes >= self.MAX_HANDSHAKES
            if not busy:
                self._handshakes += 1
        if busy:
            self._refuse_at_once(sock, addr, f"{self.MAX_HANDSHAKES} handshakes in progress")
            return
        try:
            threading.Thread(
                target=self._handshake, args=(sock, addr), name="afd-handshake", daemon=True
            ).start()
        except RuntimeError as e:  # "can't start new thread"
            self._handshake_done()
            self._refuse_at_once(sock, addr, f"cannot start a handshake thread: {e}")

    def _handshake_done(self) -> None:
        with self._hs_lock:
            self._handshakes -= 1

    def _refuse_at_once(self, sock: socket.socket, addr: str, why: str) -> None:
        """Answer "busy" without blocking (a fresh socket's buffer takes it) and close."""
        self._log_refused(logger.warning, "AFD: refused connection from %s at once: %s", addr, why)
        metrics.STATS.inc("handshake_failures")
        try:
            sock.setblocking(False)
            sock.send(pack_hello(self._reply_head(STATUS_BUSY)))
        except OSError:
            pass
        sock.close()

    def _reply_head(self, status: str) -> dict:
        return {
            "role": "ffn",
            "rank": self.ctx.rank,
            "protocol": PROTOCOL_VERSION,
            "auth": AUTH_REQUIRED if self.secret else AUTH_NONE,
            "status": status,
        }

    def _reply(self, sock: socket.socket, status: str, **extra) -> None:
        payload = _hello_payload(self.ctx, "ffn")
        payload.update(self._reply_head(status), **extra)
        try:
            send_hello(sock, payload, 5.0, "new peer")
        except AFDPeerError:
            pass

    def _handshake(self, sock: socket.socket, addr: str) -> None:
        try:
            accepted = self._handshake_or_drop(sock, addr)
        except Exception as e:  # noqa: BLE001 - a stranger must never kill this thread
            logger.warning("AFD: dropped connection from %s: %s", addr, printable(str(e)))
            sock.close()
            accepted = False
        finally:
            self._handshake_done()
        if not accepted:
            metrics.STATS.inc("handshake_failures")

    def _handshake_or_drop(self, sock: socket.socket, addr: str) -> bool:
        """True when the peer was accepted; otherwise the connection is closed."""
        deadline = time.monotonic() + min(10.0, self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            remote = recv_hello(sock, deadline, addr)
        except (AFDPeerError, AFDProtocolError) as e:
            logger.warning("AFD: dropped connection from %s: %s", addr, e)
            sock.close()  # not this protocol: no answer
            return False
        rank = self._hello_rank(sock, addr, remote)
        if rank is None:
            return False
        if remote.get("protocol") not in (None, PROTOCOL_VERSION):
            # Named before authentication: a secret of another protocol cannot pass.
            return self._refuse_hello(sock, addr, fingerprint_mismatch(
                {"protocol": PROTOCOL_VERSION}, {"protocol": remote.get("protocol")}))  # fmt: skip
        proof = self._authenticate(sock, addr, rank, remote, deadline)
        if proof is None:
            return False
        mismatch = fingerprint_mismatch(_hello_payload(self.ctx, "ffn"), remote)
        if mismatch is None and remote.get("role") != "attention":
            mismatch = f"peer role is {shown(remote.get('role'))}, expected 'attention'"
        if mismatch is None and rank not in self.expected:
            mismatch = self._guest_refusal(rank, remote)
        if mismatch:
            return self._refuse_hello(sock, addr, mismatch, proof)
        return self._admit(rank, sock, addr, proof)

    def _guest_refusal(self, rank: int, remote: dict) -> str | None:
        """Why attention rank ``rank``, not one of this FFN rank's own, is refused;
        None when it is taken as a guest: its hello says it fails over here (its home
        FFN rank is away), it is a rank of this deployment (the fingerprint matched)
        and this FFN rank has ffn_failover."""
        why = (
            f"attention rank {shown(rank)} is not served by FFN rank {self.ctx.rank} "
            f"(it serves {sorted(self.expected)})"
        )
        if remote.get(HELLO_FAILOVER) is not True:
            return why
        if not self.takes_guests:
            return (
                f"{why}; it fails over here, but this FFN server does not take guests: set "
                "connector_extra_config.ffn_failover true on every server of the deployment"
            )
        if not 0 <= rank < self.ctx.config.num_attention_ranks:
            return f"{why}; no such attention rank in this deployment"
        return None

    def _hello_rank(self, sock: socket.socket, addr: str, remote: dict) -> int | None:
        rank = remote.get("rank")
        if (
            not isinstance(remote.get("role"), str)
            or not isinstance(rank, int)
            or isinstance(rank, bool)
            or not isinstance(remote.get("afd_revision"), str)
        ):
            logger.warning("AFD: refused %s: hello lacks role/rank/afd_revision", addr)
            self._reply(
                sock, "refused: hello lacks a string role, an integer rank and afd_revision"
            )
            sock.close()
            return None
        return rank

    def _refuse_hello(self, sock: socket.socket, addr: str, mismatch: str, extra=None) -> bool:
        self._reply(sock, mismatch, **(extra or {}))
        sock.close()
        # The attention rank ends on this reply. This rank does not: a hello is
        # not proof of anything (without a shared secret anyone can send one),
        # so it keeps serving its peers or waiting for the right ones; if those
        # never come, the start-up timeout error names this refusal.
        self._last_refusal = f"{mismatch} (peer {addr})"
        logger.error("AFD: refused attention hello: %s", self._last_refusal)
        return False

    def _authenticate(
        self, sock: socket.socket, addr: str, rank: int, remote: dict, deadline: float
    ) -> dict | None:
        """Challenge-response when this rank has a secret: the attention rank
        proves it over this rank's fresh nonce. Returns the fields that prove it
        back (for the accepting reply), or None when the peer was refused."""
        offered = remote.get("auth") == AUTH_REQUIRED
        if not self.secret:
            if not offered:
                return {}
            logger.warning(
                "AFD: refused %s: the attention rank has a shared secret, this FFN rank has "
                "none ($%s is not set here): set the same secret on both servers",
                addr,
                self.secret_env,
            )
            self._reply(
                sock,
                "authentication mismatch: the attention rank has a shared secret, this FFN "
                f"server has none (set the same {self.secret_env} on both servers)",
            )
            sock.close()
            return None
        attention_nonce = remote.get("nonce")
        if not offered or not is_nonce(attention_nonce):
            return self._auth_failed(sock, addr, AUTH_MISSING, "none offered")
        ffn_nonce = new_nonce()
        try:
            send_hello(sock, {**self._reply_head(STATUS_CHALLENGE), "nonce": ffn_nonce},
                       5.0, addr)  # fmt: skip
            answer = recv_hello(sock, deadline, addr)
        except (AFDPeerError, AFDProtocolError) as e:
            logger.warning("AFD: dropped connection from %s: %s", addr, e)
            sock.close()
            return None
        expected = auth_proof(self.secret, "attention", rank, self.ctx.rank,
                              attention_nonce, ffn_nonce)  # fmt: skip
        if not proof_matches(expected, answer.get("proof")):
            return self._auth_failed(sock, addr, AUTH_DIFFERS, "wrong proof")
        return {"proof": auth_proof(self.secret, "ffn", rank, self.ctx.rank,
                                    attention_nonce, ffn_nonce)}  # fmt: skip

    def _auth_failed(self, sock: socket.socket, addr: str, status: str, why: str) -> None:
        logger.warning("AFD: dropped connection from %s: bad shared secret (%s)", addr, why)
        self._reply(sock, status)
        sock.close()
        return None

    def _admit(self, rank: int, sock: socket.socket, addr: str, proof: dict) -> bool:
        """Reserve the rank, set up its device channel with the lock released
        (wait_step of the other peers takes it; the cuda_ipc exchange can take
        seconds), then register it."""
        with self._lock:
            taken = rank in self.peers or rank in self._joining
            if not taken:
                self._joining.add(rank)
        if taken:
            self._reply(sock, f"attention rank {rank}{ALREADY_CONNECTED}")
            sock.close()
            return False
        try:
            self._reply(sock, STATUS_OK, **proof)
            self._accept_device(rank, sock, addr)
        except Exception as e:  # noqa: BLE001 - this peer is refused, serving goes on
            with self._lock:
                self._joining.discard(rank)
            logger.error("AFD: attention rank %d from %s: device channel failed: %s", rank, addr, e)
            sock.close()
            return False
        with self._lock:
            self._joining.discard(rank)
            if self._stop.is_set():  # closed meanwhile
                sock.close()
                return False
            self.peers[rank] = Peer(rank, sock, addr)
            guest = rank not in self.expected
            if guest:
                self.guests.add(rank)
            if self.expected <= set(self.peers):
                self._ever_complete = True
        if guest:
            logger.warning(
                "AFD: FFN rank %d took attention rank %d from %s as a guest (failover: its "
                "own FFN rank %d is away); serving it until it goes back",
                self.ctx.rank, rank, addr, self.ctx.config.ffn_rank_of(rank),
            )  # fmt: skip
        else:
            logger.info(
                "AFD: FFN rank %d accepted attention rank %d from %s", self.ctx.rank, rank, addr
            )
        return True

    def _accept_device(self, rank: int, sock: socket.socket, addr: str) -> None:
        """After an accepted hello: set up the data plane's side of the session. Runs
        in the handshake thread without the connector lock."""
        link = Link(sock, f"attention rank {rank} at {addr}", self.timeout, rank, self.ctx.rank)
        self.plane.attach(link, time.monotonic() + min(10.0, self.timeout))

    def _link(self, p: Peer) -> Link:
        return Link(p.sock, p.name, self.timeout, p.rank, self.ctx.rank)

    # -- serving -------------------------------------------------------------
    def wait_step(self, timeout: float) -> list[StepPeer]:
        with self._lock:
            peers = list(self.peers.values())
            complete = self._ever_complete
        now = time.monotonic()
        if not complete and not self._elastic and now - self._started_at > self.timeout:
            missing = sorted(self.expected - {p.rank for p in peers})
            refused = f" Last refused hello: {self._last_refusal}." if self._last_refusal else ""
            raise AFDPeerError(
                f"AFD FFN rank {self.ctx.rank} on {self.addr[0]}:{self.addr[1]}: attention "
                f"rank(s) {missing} did not connect within timeout_s={self.timeout:g}."
                f"{refused} Start the attention server(s) with the same --afd-config and "
                "the same model."
            )
        if not peers:
            time.sleep(min(timeout, 0.05))
            return []
        ready = self._poll(peers, timeout)
        if ready and self.batch_window > 0 and len(ready) < len(peers):
            # Give the other recently active attention ranks a moment to join
            # this step, so that their tokens share one FFN pass.
            now = time.monotonic()
            got = {r.rank for r in ready}
            waiting = [p for p in peers if p.rank not in got and not p.rx
                       and now - p.last_step < self.ACTIVE_S]  # fmt: skip
            deadline = now + self.batch_window
            while waiting and (left := deadline - time.monotonic()) > 0:
                more = self._poll(waiting, left)
                ready += more
                got |= {m.rank for m in more}
                waiting = [p for p in waiting if p.rank not in got]
        now = time.monotonic()
        for r in ready:
            if (peer := self.peers.get(r.rank)) is not None:
                peer.last_step = now
                peer.held = False  # handed out: its next bytes are read for the step
                peer.awaits_output = False
        return ready

    def _poll(self, peers: list[Peer], timeout: float) -> list[StepPeer]:
        if self.plane.polls_steps:
            return self._poll_plane_steps(peers, timeout)
        # Peers that said goodbye meanwhile are gone (their sockets closed).
        peers = [p for p in peers if self.peers.get(p.rank) is p]
        if not peers:
            time.sleep(min(timeout, 0.05))
            return []
        return self._read_sockets(peers, timeout)

    # -- step control by the plane (FFNPlane.polls_steps) ----------------------------
    def _poll_plane_steps(self, peers: list[Peer], timeout: float) -> list[StepPeer]:
        """The step-control messages of ``peers`` from the plane (device flags), waiting
        up to ``timeout``; their connections are checked every 5 ms meanwhile."""
        deadline = time.monotonic() + timeout
        last_sock_check = 0.0
        while True:
            # Peers that left (goodbye) or were dropped meanwhile are gone.
            peers = [p for p in peers if self.peers.get(p.rank) is p]
            if not peers:
                time.sleep(min(timeout, 0.05))
                return []
            ready = self._device_ready(peers)
            if ready:
                now = self._last_step = time.monotonic()
                got = {r.rank for r in ready}
                for p in peers:
                    if p.rank in got:
                        p.last_seen = now
                return ready
            now = time.monotonic()
            if now - last_sock_check > 0.005:
                last_sock_check = now
                self._check_sockets(peers)
            if now >= deadline:
                return []
            time.sleep(self._poll_pause(now))

    def _poll_pause(self, now: float) -> float:
        """Seconds between two polls of the plane: none while steps flow (the FFN rank
        has nothing else to do then; a poll is a small copy and a stream sync, and the
        time the host takes to notice a step is on the step's path), IDLE_POLL_S once
        HOT_S passed without a step; 20 us always without the plane's hot_poll."""
        if not self.hot_poll:
            return 20e-6
        return 0.0 if now - self._last_step < self.HOT_S else self.IDLE_POLL_S

    def _check_sockets(self, peers: list[Peer]) -> None:
        """Heartbeats, goodbyes and profiler requests; steps come by the plane. A lost
        (closed, silent) rank is dropped there, its device waits released."""
        for step in self._read_sockets(peers, 0):
            p = next(p for p in peers if p.rank == step.rank)
            self._lose(p, f"AFD {p.name} broke the protocol: step control over TCP with "
                       f"the {self.ctx.config.connector} connector")  # fmt: skip

    def _device_ready(self, peers: list[Peer]) -> list[StepPeer]:
        """The new step-control messages of ``peers`` (``FFNPlane.poll_steps``). A
        session the plane found failed (its device wait gave up, a broken protocol) ends
        alone; the others are served on."""
        by_rank = {p.rank: p for p in peers}
        ready = []
        for rank, ctrl, why in self.plane.poll_steps([(p.rank, p.name) for p in peers]):
            p = by_rank[rank]
            if why is not None:
                self._end_session(p, why)
            else:
                ready.append(StepPeer(rank, ctrl, p))
        return ready

    def _end_session(self, p: Peer, why: str) -> None:
        """Release this rank's device waits and close its connection (its attention
        server sees EOF and ends or rejoins); the FFN rank serves the others."""
        logger.error("AFD: %s; its session ends, the other attention ranks are served on", why)
        self._lose(p, why)

    def _read_sockets(self, peers: list[Peer], timeout: float) -> list[StepPeer]:
        """The step-control messages of ``peers``, waiting up to ``timeout`` for one while
        the bytes of every rank move (:meth:`pump`); back early, with none, when a message
        posted for a step arrived. Nothing here waits on one rank's bytes: a control frame
        that has begun to arrive is read as the rest comes, and a rank whose own deadline
        passed is dropped (silent for timeout_s, or stopped mid-frame) while the others
        are served on."""
        deadline = time.monotonic() + timeout
        while True:
            steps = self._take_steps(peers)
            if steps:
                return steps
            left = deadline - time.monotonic()
            if self.pump(max(0.0, left)) or left <= 0:
                return self._take_steps(peers)

    def _take_steps(self, peers: list[Peer]) -> list[StepPeer]:
        """The step-control messages read for ``peers``. Their ranks stay held (nothing of
        theirs is read: the step's data follows) until wait_step hands the steps out; the
        runner posts the data's receives before it pumps again."""
        mine = {id(p) for p in peers}
        out, keep = [], []
        for step in self._steps:
            if self.peers.get(step.rank) is not step.session:
                continue  # that session is gone
            (out if id(step.session) in mine else keep).append(step)
        self._steps = keep
        return out

    # -- the byte pump -------------------------------------------------------
    def pump(self, timeout: float, only: Peer | None = None) -> bool:
        """One round of socket I/O for every attention rank: read what arrived into the
        messages posted for its step (between steps, into its next control frame), write
        what its socket takes of the bytes queued for it, and end the session of a rank
        whose own deadline passed (:meth:`_due`). ``only``: that rank alone, in a step
        served by blocking calls (no control frame is read between them). Waits up to
        ``timeout`` for a socket to be ready, less when a deadline comes first. True when
        a posted message arrived or a rank with one posted was lost."""
        if only is not None:
            peers = [only] if self.peers.get(only.rank) is only else []
        else:
            with self._lock:
                peers = list(self.peers.values())
        if not peers:
            time.sleep(max(0.0, min(timeout, 0.05)))
            return False
        now = time.monotonic()
        wake = now + max(0.0, timeout)
        for p in peers:
            due = self._due(p)
            if due is not None:
                wake = min(wake, due)
        between = only is None
        wants = [(p.sock, p.reading(between) is not None, bool(p.tx)) for p in peers]
        if self.plane.polled and self._plane_owed(peers):
            wants = [(sock, read or self._watch_eof(p, between), write)
                     for p, (sock, read, write) in zip(peers, wants)]  # fmt: skip
            ready = self._poll_capped(wants, max(0.0, wake - now))
            event = self._poll_plane(peers)
            for p, (can_read, _) in zip(peers, ready):
                if can_read and p.reading(between) is None and self.peers.get(p.rank) is p:
                    event |= self._peek_eof(p)
        else:
            ready = poll_io(wants, max(0.0, wake - now))
            event = False
        for p, (can_read, can_write) in zip(peers, ready):
            if self.peers.get(p.rank) is not p:
                continue  # dropped meanwhile (a goodbye)
            in_step = bool(p.rx)
            try:
                if can_write:
                    self._write(p)
                if can_read:
                    event |= self._read(p, between)
                due = self._due(p)
                if due is not None and time.monotonic() >= due:
                    raise AFDPeerError(self._overdue(p))
            except AFDPeerError as e:
                self._lose(p, str(e))
                event |= in_step
                if not self.survives_peer_loss:
                    raise
        return event

    def _due(self, p: Peer) -> float | None:
        """When the session of ``p`` ends unless its bytes move: timeout_s after the last
        byte either way (or the post of a message) while a posted message has not arrived
        or queued bytes are not taken; between steps timeout_s after the last byte it sent
        (heartbeats come every second). None while it waits for this side only (a step
        held, a message posted for it, or a layer input taken whose output is not sent)."""
        if p.tx or p.owes() or p.sends:
            return p.progress + self.timeout
        if p.rx or p.held or p.awaits_output:
            return None
        return p.last_seen + self.timeout

    def _overdue(self, p: Peer) -> str:
        if p.tx:
            return f"AFD peer {p.name} stopped reading (send timed out)"
        if p.owes():
            return f"AFD peer {p.name} did not answer within the timeout"
        if p.sends:
            return f"AFD peer {p.name} did not take its layer output (send timed out)"
        return f"lost AFD {p.name}: nothing received for {self.timeout:g} s"

    def _read(self, p: Peer, between_steps: bool = True) -> bool:
        """Read what the socket of ``p`` holds now, message by message (never past the
        message being read); True when a posted message arrived."""
        arrived = False
        while (m := p.reading(between_steps)) is not None:
            k = recv_some(p.sock, m.rest(), p.name)
            if not k:
                break
            m.got += k
            p.last_seen = p.progress = time.monotonic()
            if not m.arrived:
                continue
            if m is p.ctrl:  # between steps
                p.ctrl = None
                ctrl = self._on_control(p, bytes(m.view))
                if ctrl is not None:
                    p.held = True
                    self._steps.append(StepPeer(p.rank, ctrl, p))
            elif m.is_control:  # a later micro-batch of the step
                m.value = self._on_control(p, bytes(m.view))
                if m.value is None:
                    m.got = 0  # a heartbeat or a profiler request: the next frame
                else:
                    arrived = True
            else:
                arrived = True
            if self.peers.get(p.rank) is not p:
                break  # said goodbye
        return arrived

    def _write(self, p: Peer) -> None:
        """Write what the socket of ``p`` takes now of its queued bytes."""
        while p.tx:
            view, owner = p.tx[0]
            k = send_some(p.sock, view, p.name)
            if not k:
                return
            p.progress = time.monotonic()
            if k == len(view):
                p.tx.popleft()
            else:
                p.tx[0] = (view[k:], owner)

    def _on_control(self, p: Peer, data: bytes) -> Control | None:
        """A control frame of ``p``: its step-control message; None for a heartbeat, a
        goodbye (the session ends) or a profiler request."""
        try:
            ctrl = Control.unpack(data, self.ctx.max_num_tokens)
            p.check_step(ctrl)
        except AFDProtocolError as e:  # the session ends (the caller drops it)
            raise AFDPeerError(f"AFD {p.name} broke the protocol: {e}") from e
        if ctrl.type == MSG_HEARTBEAT:
            return None
        if ctrl.type == MSG_GOODBYE:
            logger.info("AFD: %s said goodbye", p.name)
            self._drop(p)
            return None
        if ctrl.type == MSG_PROFILE:
            with self._lock:
                self._profile_requests.append(bool(ctrl.flags))
            return None
        return ctrl

    # -- a polled data plane (FFNPlane.polled: nixl) --------------------------
    def _plane_owed(self, peers: list[Peer]) -> bool:
        """A message or a send of the polled plane is outstanding for one of ``peers``."""
        return any(p.sends or any(m.check is not None and not m.arrived for m in p.rx)
                   for p in peers)  # fmt: skip

    def _watch_eof(self, p: Peer, between: bool) -> bool:
        """While ``p`` owes only messages of the polled plane its socket is not read (a
        frame there belongs to later); watched for EOF or an error all the same (the rank
        ended its session: a failed step shuts its connection down), unless bytes of a
        frame wait there unread."""
        if p.reading(between) is not None:
            self._unread.discard(id(p))
            return False
        return bool(p.rx) and id(p) not in self._unread

    def _peek_eof(self, p: Peer) -> bool:
        """The socket of ``p`` is readable while none of its bytes are wanted: EOF or an
        error loses the session now (True when it had messages posted); bytes of a later
        frame are left there, and the socket unwatched until they are wanted."""
        try:
            data = p.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            why = f"lost AFD {p.name} during a step: {e}"
        else:
            if data:
                self._unread.add(id(p))
                return False
            why = f"lost AFD {p.name} during a step: it closed the connection"
        in_step = bool(p.rx)
        self._lose(p, why)
        if not self.survives_peer_loss:
            raise AFDPeerError(why)
        return in_step

    def _poll_capped(self, wants: list, wait: float) -> list[tuple[bool, bool]]:
        """poll_io while the polled plane has messages outstanding: its arrivals cannot be
        select()ed, so the sockets (controls, EOF) are waited for no longer than the plane
        says (FFNPlane.idle_wait), then the pump checks the plane again."""
        wait = min(wait, self.plane.idle_wait(time.monotonic() - self._plane_moved))
        if wait >= 0.001:
            return poll_io(wants, wait)
        ready = poll_io(wants, 0.0)
        if wait > 0 and not any(r or w for r, w in ready):
            time.sleep(wait)
        return ready

    def _poll_plane(self, peers: list[Peer]) -> bool:
        """One round of the polled plane: drive its transfers, then finish the posted
        messages that arrived and forget the sends that completed, of every rank at once.
        True when a posted message arrived or a rank with one posted was lost (its own
        session only: AFDPeerError of its checks)."""
        self.plane.progress()
        event = moved = False
        for p in peers:
            if self.peers.get(p.rank) is not p:
                continue
            try:
                arrived = False
                for m in p.rx:
                    arrived |= m.poll()
                n = len(p.sends)
                if n:
                    p.sends = type(p.sends)(done for done in p.sends if not done())
                if arrived or len(p.sends) < n:
                    p.last_seen = p.progress = time.monotonic()
                    moved = True
                event |= arrived
            except AFDPeerError as e:
                in_step = bool(p.rx)
                self._lose(p, str(e))
                event |= in_step
                if not self.survives_peer_loss:
                    raise
        if moved:
            self._plane_moved = time.monotonic()
        return event

    # -- posted I/O of a step (async_io) -------------------------------------
    def post_recv(self, peer: StepPeer, out: torch.Tensor) -> None:
        """Receive this peer's next message (a layer input) into ``out`` as its bytes
        arrive; :meth:`arrived` tells when, :meth:`take` finishes it. With a polled data
        plane the message is the plane's (on the lane of the peer's micro-batch)."""
        p = self._peer(peer)
        if self.plane.polled:
            lane = ubatch_of(peer.control.flags)[0]
            self._post(p, Inbound.polled(self.plane.recv_posted(self._link(p), out, lane)))
            self._plane_moved = time.monotonic()
            return
        self._post(p, Inbound.tensor(out))

    def post_control(self, peer: StepPeer) -> None:
        """Receive the control message of this peer's next micro-batch (DBO); :meth:`take`
        gives it."""
        self._post(self._peer(peer), Inbound.control())

    def _post(self, p: Peer, m: Inbound) -> None:
        if not p.owes():
            p.progress = time.monotonic()  # its deadline counts from now
        p.rx.append(m)

    def arrived(self, peer: StepPeer) -> bool:
        """Every message posted for this peer has arrived; AFDPeerError, naming why, when
        its session is gone."""
        return not self._peer(peer).owes()

    def take(self, peer: StepPeer) -> list[Control]:
        """Finish the messages of this peer that arrived (copies out of host staging) and
        forget them; the control messages among them."""
        p = self._peer(peer)
        controls = []
        while p.rx and p.rx[0].arrived:
            m = p.rx.popleft()
            m.finish()
            if m.is_control:
                controls.append(m.value)
        return controls

    def post_send(self, peer: StepPeer, y: torch.Tensor) -> None:
        """Send this peer's layer output: what its socket takes now, the rest as it reads
        (:meth:`pump`); never waits. With a polled data plane the plane sends it, and
        the pump sees it complete."""
        p = self._peer(peer)
        if self.plane.polled:
            lane = ubatch_of(peer.control.flags)[0]
            try:
                done = self.plane.send_posted(self._link(p), y, lane)
            except AFDPeerError as e:
                self._lose(p, str(e))
                raise
            if not p.sends:
                p.progress = time.monotonic()
            p.sends.append(done)
            self._plane_moved = time.monotonic()
            return
        host = y.contiguous() if y.device.type == "cpu" else y.contiguous().cpu()
        view = tensor_bytes(host)
        if not len(view):
            return
        if not p.tx:
            p.progress = time.monotonic()
        p.tx.append((view, host))
        try:
            self._write(p)
        except AFDPeerError as e:
            self._lose(p, str(e))
            raise

    def _wait(self, p: Peer, done: Callable[[], bool], gone: str | None = None) -> None:
        """Pump the socket of ``p`` alone until ``done()``; AFDPeerError when its session
        ends meanwhile (its own deadline, EOF, a goodbye: ``gone``)."""
        while True:
            if self.peers.get(p.rank) is not p:
                raise AFDPeerError(p.why or gone or f"lost AFD {p.name} during a step")
            if done():
                return
            self.pump(self.timeout, only=p)

    def recv_control(self, peer: StepPeer) -> Control:
        """The next step-control message of this peer, within timeout_s (a later
        micro-batch of the step being served); from the counts micro-batch 0 announced
        where the plane has them (``ubatch_controls_upfront``: no wait)."""
        if self.plane.ubatch_controls_upfront:
            return self.plane.recv_control(peer.rank, peer.control)
        p = self._peer(peer)
        self.post_control(peer)
        self._wait(p, lambda: not p.owes(), f"lost AFD {p.name} during a micro-batched step")
        return self.take(peer)[-1]

    def take_profile_requests(self) -> list[bool]:
        with self._lock:
            requests, self._profile_requests = self._profile_requests, []
        return requests

    def peer_states(self) -> dict[str, bool]:
        """This FFN rank's own attention ranks (guests are in guest_ranks())."""
        with self._lock:
            connected = set(self.peers)
        return {f"attention_rank_{r}": r in connected for r in sorted(self.expected)}

    def guest_ranks(self) -> list[int]:
        """The attention ranks of other replicas served here now (failover)."""
        with self._lock:
            return sorted(self.guests)

    def _drop(self, p: Peer) -> bool:
        """Forget this session of a rank and close it; True when it was current."""
        with self._lock:
            current = self.peers.get(p.rank) is p
            guest = current and p.rank in self.guests
            if current:
                del self.peers[p.rank]
                self.guests.discard(p.rank)
        if current:
            self.plane.detach(self._link(p))
        try:
            p.sock.close()
        except OSError:
            pass
        if guest:
            logger.info("AFD: FFN rank %d let guest attention rank %d go", self.ctx.rank, p.rank)
        return current

    def _lose(self, p: Peer, why: str) -> None:
        """The session ``p`` failed: drop it (the rank may connect again). Runs in
        the serve thread, the only one that removes peers: a session still current
        here cannot be replaced by a new handshake of its rank meanwhile."""
        if self.peers.get(p.rank) is not p:
            self._drop(p)
            return  # dropped before (a goodbye, or this loss was seen already)
        self._release(p)
        p.why = self.lost[p.rank] = why
        self._drop(p)
        p.rx.clear()
        p.tx.clear()
        p.sends.clear()
        if self.survives_peer_loss:
            logger.warning(
                "AFD: FFN rank %d lost attention rank %d (%s); serving the other attention "
                "ranks, rank %d is taken again when its server reconnects",
                self.ctx.rank, p.rank, why, p.rank,
            )  # fmt: skip

    def _release(self, p: Peer) -> None:
        """Before a lost session is dropped: free what its rank's steps may still
        wait on (the plane's device waits, ``FFNPlane.release``)."""
        self.plane.release(self._link(p))

    def drop_peer(self, peer: StepPeer, why: str) -> None:
        p = peer.session if isinstance(peer.session, Peer) else self.peers.get(peer.rank)
        if p is not None:
            self._lose(p, why)

    def _peer(self, step_peer: StepPeer) -> Peer:
        p = self.peers.get(step_peer.rank)
        if p is None or step_peer.session not in (None, p):
            why = getattr(step_peer.session, "why", None)
            raise AFDPeerError(why or f"lost AFD attention rank {step_peer.rank} during a step")
        return p

    def recv(self, peer: StepPeer, out: torch.Tensor) -> None:
        """This peer's layer input, waiting for it alone (with async_io the runner posts
        instead): posted on the channel's connection, or the data plane's receive (with
        ``FFNPlane.polls_inputs``, outside a CUDA graph capture, once the input arrived:
        ``_await_input``)."""
        p = self._peer(peer)
        if not self.async_io:
            lane = ubatch_of(peer.control.flags)[0]
            if self.plane.polls_inputs and not _capturing(out):
                self._await_input(p, lane)
            self.plane.recv(self._link(p), out, lane)
            p.last_seen = time.monotonic()
            p.awaits_output = True
            return
        self.post_recv(peer, out)
        self._wait(p, lambda: not p.owes())
        self.take(peer)

    def _await_input(self, p: Peer, lane: int) -> None:
        """Wait on the host until the plane has the next layer input of ``p`` (its
        receive then waits for nothing on the device), checking the connection every
        5 ms (EOF, goodbye). AFDPeerError naming the rank when it does not come within
        timeout_s: the runner drops that rank alone (its waits released) and serves the
        other ranks of the pass on, instead of a device wait of up to timeout_s per
        remaining layer holding them all."""
        link = self._link(p)
        deadline = time.monotonic() + self.timeout
        last_sock_check = time.monotonic()
        while not self.plane.input_ready(link, lane):
            now = time.monotonic()
            if now >= deadline:
                raise AFDPeerError(f"AFD {p.name} did not send layer data within "
                                   f"timeout_s={self.timeout:g}")  # fmt: skip
            if now - last_sock_check > 0.005:
                last_sock_check = now
                self._check_sockets([p])
                if self.peers.get(p.rank) is not p:
                    raise AFDPeerError(p.why or f"lost AFD {p.name} during a step")
            time.sleep(0.0 if self.hot_poll else 20e-6)

    def send(self, peer: StepPeer, y: torch.Tensor) -> None:
        """This peer's layer output, until its socket took all of it (or the plane's)."""
        p = self._peer(peer)
        if not self.async_io:
            self.plane.send(self._link(p), y, ubatch_of(peer.control.flags)[0])
            p.awaits_output = False
            p.last_seen = time.monotonic()  # its silence counts from now again
            return
        self.post_send(peer, y)
        self._wait(p, lambda: not p.tx and not p.sends)

    def close(self) -> None:
        self.plane.release(None)  # device waits of every session end now
        self._stop.set()
        if self.listener is not None:
            self.listener.close()
        with self._lock:
            for p in self.peers.values():
                try:
                    p.sock.close()
                except OSError:
                    pass
            self.peers.clear()
            self.guests.clear()
        self.plane.close()


register_connector("gloo", TCPAttentionConnector, TCPFFNConnector)


def channel_connectors(
    attention_plane: type[AttentionPlane],
    ffn_plane: type[FFNPlane],
    name: str,
    exposes: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
) -> tuple[type[TCPAttentionConnector], type[TCPFFNConnector]]:
    """The connector classes of a data plane: the control channel composed with the
    plane's two sides. They add nothing but the plane (and its declared capabilities)
    and, read and written through to it, the plane members named in ``exposes``
    (attention side, FFN side): the names its tests and tools reach the plane's state by."""

    def init_attention(self, ctx: ConnectorContext) -> None:
        TCPAttentionConnector.__init__(self, ctx, attention_plane(ctx))

    def init_ffn(self, ctx: ConnectorContext) -> None:
        TCPFFNConnector.__init__(self, ctx, ffn_plane(ctx))

    attention = type(
        f"{name}AttentionConnector",
        (TCPAttentionConnector,),
        {"__init__": init_attention, "graph_capable": attention_plane.graph_capable,
         "dbo_capable": attention_plane.dbo_capable, "plane_class": attention_plane,
         **{m: _plane_member(m) for m in exposes[0]}},
    )  # fmt: skip
    ffn = type(
        f"{name}FFNConnector",
        (TCPFFNConnector,),
        {"__init__": init_ffn, "graph_capable": ffn_plane.graph_capable,
         "dbo_capable": ffn_plane.dbo_capable, "plane_class": ffn_plane,
         "ubatch_controls_upfront": ffn_plane.ubatch_controls_upfront,
         **{m: _plane_member(m) for m in exposes[1]}},
    )  # fmt: skip
    return attention, ffn


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _plane_member(name: str) -> property:
    """The plane's member ``name``, read and written through the connector."""
    return property(lambda self: getattr(self.plane, name),
                    lambda self, value: setattr(self.plane, name, value),
                    doc=f"The data plane's ``{name}``.")  # fmt: skip
