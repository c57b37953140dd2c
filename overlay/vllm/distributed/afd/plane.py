# SPDX-License-Identifier: Apache-2.0
"""Data planes of the AFD control channel: how one layer's activations move.

A connector is the control channel (``vllm.distributed.afd.tcp``: hello, authentication,
fingerprint, sessions, step ids, heartbeats, rejoin, failover) composed with a data plane.
The channel owns the connection of each attention rank; it lends the plane a :class:`Link`
(that connection, the peer's name, the timeout) once the handshake has accepted the peer,
and takes it back (``detach``) when the session ends: lost, failed over, closed. A plane
never opens, authenticates or heartbeats a connection of its own, and holds nothing of a
peer beyond its session, so a restarted peer is met as a new one.

The socket plane (``gloo``) sends the activations over the channel's own connection; the
NIXL plane (``nixl``) writes them one-sidedly into the peer's registered inbox; the
cuda_ipc plane (``vllm.distributed.afd.cuda_ipc``) copies them into the peer's inbox
mapped by CUDA IPC and signals device flags, the step control included; the NCCL plane
(``vllm.distributed.afd.nccl``) sends both by PyNccl, one communicator per session. Each
plane is described by its connector's spec record (``vllm.afd.connector_spec``), which
names the connector classes; ``channel_connectors`` composes the plane with the channel.

A plane of device work declares what it needs of the channel, with hooks whose defaults
leave the others as they are ("device sessions" below): ``device_session`` (the channel
passes the step's calls through, keeps no open step and watches the session with a
watchdog thread: ``probe``, ``hold``), ``open_step`` (a step's control with its
micro-batches' token counts), ``rejoins`` and ``checks_every_forward`` (the rejoin of
vllm.afd.rejoin), ``shares_device``; on the FFN side ``polls_steps`` (the step control
comes by the plane: ``poll_steps``), ``ubatch_controls_upfront`` (``recv_control``),
``start``, ``release`` (a failed session's device waits end now), ``generation`` and
``polls_inputs`` (``input_ready``: the host waits for a rank's layer input, with its own
deadline, before it enqueues the receive).
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.afd.protocol import AFDPeerError, ubatch_flags
from vllm.distributed.afd.channel import recv_tensor, send_tensor


@dataclass
class Link:
    """One attention rank's session as the channel lends it to the plane."""

    sock: socket.socket
    peer: str  # the other side's name in messages ("FFN rank 0 at host:port", ...)
    timeout: float
    rank: int  # the attention rank of the session
    ffn_rank: int  # the FFN rank of the session
    # Attention side, for a plane that carries the step control (``carries_control``):
    # control(num_tokens, flags) sends a step's control message over this session's
    # connection (any thread); lost(why) reports the session failed in the plane.
    control: Callable[[int, int], None] | None = None
    lost: Callable[[str], None] | None = None


class AttentionPlane(ABC):
    """The attention rank's side of a data plane (one FFN peer at a time)."""

    # Capabilities, declared (the spec record says the same; the registry checks).
    graph_capable = False
    dbo_capable = False
    # The exchanges are device work that a lost FFN rank leaves unfinished: the forward
    # is re-run whole once the rank is back (vllm.afd.rejoin.run_forward; ``step_lost``
    # says whether a forward was clean).
    reruns_forward = False
    # The step's control message is device work too (``begin_step``), sent on by the
    # plane through ``Link.control``; else the channel sends it from the host.
    carries_control = False

    def __init__(self, ctx):
        self.ctx = ctx
        self.link: Link | None = None

    def connect(self, link: Link, deadline: float) -> object:
        """Right after the channel's handshake on a new connection (first connect,
        rejoin, failover, the move back home): set up the data path with the FFN rank
        before ``deadline``, exchanging messages over ``link.sock`` (the FFN side's
        ``attach`` answers them). Returns an offer for ``attach``; must not disturb the
        live session (a move back home prepares while the guest session serves)."""
        return None

    def attach(self, link: Link, offer: object) -> None:
        """Take the session that ``connect`` prepared (under the channel's lock, between
        steps)."""
        self.link = link

    def discard(self, offer: object) -> None:
        """An offer that will not be taken (the connection is closed instead)."""
        return None

    def detach(self) -> None:
        """The session ended: forget the peer (its buffers, registrations, background
        receives). Idempotent."""
        self.link = None

    def lost(self, why: str) -> None:
        """The channel found the FFN rank lost (any thread): release what waits on it."""
        return None

    def begin_step(self, num_tokens: int, flags: int) -> None:
        """``carries_control``: enqueue the step's control message."""
        raise NotImplementedError(f"the {type(self).__name__} does not carry the control")

    def step_lost(self) -> str | None:
        """``reruns_forward``: after a forward, why its exchanges failed (None: clean)."""
        return None

    # ``lane``: the micro-batch of the message (0 outside DBO); a plane may keep the
    # lanes apart (their own slots and sequence numbers) or ignore it (a byte stream).
    @abstractmethod
    def send(self, x: torch.Tensor, lane: int = 0) -> None:
        """One layer's FFN input (contiguous [num_tokens, width])."""

    @abstractmethod
    def recv(self, out: torch.Tensor, lane: int = 0) -> torch.Tensor:
        """One layer's FFN output into ``out``."""

    def recv_start(self, out: torch.Tensor, lane: int = 0) -> Callable[[], torch.Tensor]:
        """DBO: start receiving into ``out``; the returned ``wait()`` gives it."""
        raise NotImplementedError(f"the {type(self).__name__} does not serve micro-batches")

    def close(self) -> None:
        self.detach()

    # -- device sessions (cuda_ipc) ------------------------------------------------------
    # Hooks of a plane whose session is device work the host does not follow. Their
    # defaults leave the socket and NIXL planes as they are.

    # A lost FFN rank can be rejoined at all (False: a loss ends the engine; cuda_ipc
    # without ipc_rejoin, whose captured graphs hold the FFN rank's mapped addresses).
    rejoins = True
    # With ``reruns_forward``: every forward is waited for and checked (``step_lost``)
    # even where a loss is not held. None: as ``reruns_forward`` (nixl's proxy thread
    # needs it); cuda_ipc checks only the forwards whose losses are held.
    checks_every_forward: bool | None = None
    # The session is device work that the plane orders itself (device counters): the
    # channel passes begin_step (``open_step``), send, recv and recv_start to the plane
    # as they come, keeps no open step (end_step does nothing) and checks nothing before
    # an exchange. Its failures show on the device (``probe``, ``step_lost``) or as EOF of
    # the connection: a watchdog thread of the channel looks for both every 0.1 s and
    # holds a loss it finds (``hold``) where losses are held (``holds_losses``), else
    # ends the rank (``on_failure``, by default ending the process: the GPU stream may be
    # stuck behind a wait, and the step's output must not reach a client).
    device_session = False

    def open_step(
        self, num_tokens: int, ubatch: tuple[int, int] | None, ubatch_tokens: list[int] | None
    ) -> None:
        """``carries_control``: begin one step (``ubatch``: (index, count) of a DBO
        micro-batch; ``ubatch_tokens``: the token counts of all of them, for a plane
        that announces them with micro-batch 0). By default the step's control message,
        ``begin_step(num_tokens, flags)``."""
        self.begin_step(num_tokens, ubatch_flags(*ubatch) if ubatch is not None else 0)

    def probe(self) -> str | None:
        """``device_session``: why the session failed on the device (a wait that gave
        up), None while it did not. Called from the watchdog thread: must not disturb a
        CUDA graph capture in progress (skip a synchronising read meanwhile)."""
        return None

    def hold(self) -> None:
        """``device_session``: a loss is held for a re-run of the forward: end this
        side's own device waits now, so that a pass in flight finishes (its output is
        discarded) instead of waiting out timeout_s."""
        return None

    def shares_device(self) -> bool | None:
        """True when the FFN rank computes on this rank's GPU, False on another one,
        None when the plane cannot tell (``AttentionConnector.shares_device``)."""
        return None


class FFNPlane(ABC):
    """The FFN rank's side of a data plane (its attention ranks' sessions)."""

    graph_capable = False
    dbo_capable = False
    # The activations travel in the channel's own byte stream (the socket plane): the
    # channel then posts them and moves the bytes of all sessions at once
    # (TCPFFNConnector.async_io), and recv/send here are not called.
    in_channel = False

    def __init__(self, ctx):
        self.ctx = ctx

    def attach(self, link: Link, deadline: float) -> None:
        """A session was accepted (in the handshake thread, without the channel's lock):
        set up its data path before ``deadline``; raises to refuse the session."""
        return None

    def detach(self, link: Link) -> None:
        """The session of ``link`` ended: free what belongs to it. Idempotent."""
        return None

    @abstractmethod
    def recv(self, link: Link, out: torch.Tensor, lane: int = 0) -> None:
        """This session's layer input into ``out``, within ``link.timeout`` (``lane``:
        the micro-batch, from the step's control message)."""

    @abstractmethod
    def send(self, link: Link, y: torch.Tensor, lane: int = 0) -> None:
        """This session's layer output."""

    def close(self) -> None:
        """The FFN rank stops."""
        return None

    # -- posted I/O (``polled``) ---------------------------------------------------
    # The plane's messages can be posted and checked without waiting: the channel then
    # posts them beside its own control frames and serves all sessions at once
    # (TCPFFNConnector.async_io), so no session waits on another's messages; the blocking
    # recv/send above are not called by the serve loop.
    polled = False

    def recv_posted(self, link: Link, out: torch.Tensor, lane: int = 0) -> Callable[[], bool]:
        """``polled``: receive this session's next message on ``lane`` into ``out``; the
        returned ``check()`` never waits: True once the message arrived (and is in
        ``out``). Raises AFDPeerError when the session is gone."""
        raise NotImplementedError(f"the {type(self).__name__} does not post its messages")

    def send_posted(self, link: Link, y: torch.Tensor, lane: int = 0) -> Callable[[], bool]:
        """``polled``: start sending this session's layer output; the returned ``done()``
        never waits: True once the send completed (``y`` may be reused at once)."""
        raise NotImplementedError(f"the {type(self).__name__} does not post its messages")

    def progress(self) -> None:
        """``polled``: once per round of the channel's pump, before the checks: drive the
        plane's transfers (take what arrived)."""
        return None

    def idle_wait(self, waited: float) -> float:
        """``polled``: how long a round of the pump may wait for the sockets while posted
        messages of the plane are outstanding, ``waited`` seconds after the last one moved
        (the plane's messages cannot be select()ed: the pump polls them this often)."""
        return 0.0

    # -- device sessions (cuda_ipc) ------------------------------------------------------
    # Hooks of a plane whose step control comes by the device, not by the channel's
    # connection. Their defaults leave the socket and NIXL planes as they are.

    # The step-control messages come by the plane (``poll_steps``): the channel polls the
    # plane for them and reads only heartbeats, goodbyes and profiler requests from its
    # connections (a step control message there breaks the protocol).
    polls_steps = False
    # ``polls_steps``: poll back to back for a while after a step (else a short sleep
    # between polls; ``connector_extra_config.ffn_hot_poll`` of cuda_ipc).
    hot_poll = True
    # Micro-batch 0's control message announces every micro-batch of a DBO step:
    # ``recv_control`` answers the later ones without a wait.
    ubatch_controls_upfront = False
    # Bumped whenever a session's device buffers (or communicator) are new: the FFN
    # rank's CUDA graphs captured before hold the previous session's addresses.
    generation = 0

    def start(self) -> None:
        """The FFN rank starts (before it listens): set up what serves every session."""
        return None

    def poll_steps(self, sessions: list[tuple[int, str]]) -> list[tuple[int, object, str | None]]:
        """``polls_steps``: the new step-control messages of these sessions ((attention
        rank, name) each): ``(rank, Control, None)`` for a step, ``(rank, None, why)`` for
        a session that failed (the channel drops it, naming why). Never waits."""
        raise NotImplementedError(f"the {type(self).__name__} carries no step control")

    def recv_control(self, rank: int, control):
        """``ubatch_controls_upfront``: the next micro-batch's control message of the DBO
        step that ``control`` (micro-batch 0's) opened for attention rank ``rank``."""
        raise NotImplementedError(f"the {type(self).__name__} does not announce micro-batches")

    def release(self, link: Link | None) -> None:
        """The session of ``link`` failed (None: the FFN rank stops, every session): end
        now the device work that waits on it (before the channel drops it), so that the
        other ranks' passes are not held."""
        return None

    # The host can tell whether a session's next layer input has arrived before it
    # enqueues the receive (``input_ready``): the channel then waits for it on the host,
    # with the rank's own deadline, and drops a rank whose input does not come instead of
    # enqueueing a device wait that would hold the other ranks of the pass.
    polls_inputs = False

    def input_ready(self, link: Link, lane: int = 0) -> bool:
        """``polls_inputs``: the session's next layer input of micro-batch ``lane`` has
        arrived (its receive, enqueued now, waits for nothing). Never waits."""
        raise NotImplementedError(f"the {type(self).__name__} cannot poll its inputs")


# ------------------------------------------------------------------ sockets
class SocketAttentionPlane(AttentionPlane):
    """Activations over the channel's connection: raw tensor bytes whose size both sides
    know from the step's control message."""

    dbo_capable = True

    def __init__(self, ctx):
        super().__init__(ctx)
        # Background receives (recv_start): one worker, so they complete in order, on a
        # duplicate of the connection (a socket object's timeout is its own).
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._rsock: socket.socket | None = None

    def _live(self) -> Link:
        if self.link is None:
            raise AFDPeerError("AFD attention rank has no FFN session")
        return self.link

    def send(self, x: torch.Tensor, lane: int = 0) -> None:
        link = self._live()
        send_tensor(link.sock, x, link.timeout, link.peer)

    def recv(self, out: torch.Tensor, lane: int = 0) -> torch.Tensor:
        link = self._live()
        recv_tensor(link.sock, out, time.monotonic() + link.timeout, link.peer)
        return out

    def recv_start(self, out: torch.Tensor, lane: int = 0) -> Callable[[], torch.Tensor]:
        """DBO: a micro-batch starts its receive before it yields, so the FFN rank's reply
        drains while the other micro-batch sends (with both sides blocked in sends of
        messages larger than the socket buffers, neither would read)."""
        link = self._live()
        if self._reader is None:
            self._rsock = link.sock.dup()
            self._reader = concurrent.futures.ThreadPoolExecutor(1, "afd-recv")
        rsock = self._rsock

        def job() -> torch.Tensor:
            recv_tensor(rsock, out, time.monotonic() + link.timeout, link.peer)
            return out

        future = self._reader.submit(job)

        def wait() -> torch.Tensor:
            try:
                return future.result(link.timeout + 5.0)
            except concurrent.futures.TimeoutError:
                raise AFDPeerError(
                    f"AFD peer {link.peer} did not answer within the timeout"
                ) from None

        return wait

    def detach(self) -> None:
        reader, self._reader = self._reader, None
        rsock, self._rsock = self._rsock, None
        if rsock is not None:
            try:  # ends a background receive at once (EOF), not at its deadline
                rsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            rsock.close()
        if reader is not None:
            reader.shutdown(wait=False, cancel_futures=True)
        super().detach()


class SocketFFNPlane(FFNPlane):
    dbo_capable = True
    in_channel = True

    def recv(self, link: Link, out: torch.Tensor, lane: int = 0) -> None:
        recv_tensor(link.sock, out, time.monotonic() + link.timeout, link.peer)

    def send(self, link: Link, y: torch.Tensor, lane: int = 0) -> None:
        send_tensor(link.sock, y, link.timeout, link.peer)
