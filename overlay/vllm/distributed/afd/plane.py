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
NIXL plane (``nixl``) writes them one-sidedly into the peer's registered inbox. Each plane
is described by its connector's spec record (``vllm.afd.connector_spec``), which names the
plane classes; the registry composes them with the channel.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.afd.protocol import AFDPeerError
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
