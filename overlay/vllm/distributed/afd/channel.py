# SPDX-License-Identifier: Apache-2.0
"""Framed socket primitives of the AFD connectors (``tcp``, ``cuda_ipc``, ``nccl``).

Every read has a deadline and every send a timeout; a closed, reset or silent
peer becomes an :class:`~vllm.afd.protocol.AFDPeerError` naming it. Messages
are the hello frames and control structs of ``vllm.afd.protocol`` and raw
tensor bytes whose size the receiver already knows.

The FFN side reads and writes its attention ranks' sockets without blocking on any
one of them (:func:`recv_some`, :func:`send_some`, :func:`poll_io`): a message is an
:class:`Inbound` filled as its bytes arrive, and the bytes a rank has not taken yet
wait in its :class:`Peer`'s send queue, so that a rank that stops mid-frame holds
nobody but itself.
"""

from __future__ import annotations

import collections
import select
import socket
import time
from collections.abc import Callable

import torch

from vllm.afd.protocol import (
    CONTROL,
    HELLO_PREAMBLE,
    MSG_STEP,
    AFDPeerError,
    AFDProtocolError,
    Control,
    pack_hello,
    parse_hello,
    ubatch_of,
    unpack_hello_preamble,
)


# ------------------------------------------------------------------ bytes
def recv_into(sock: socket.socket, view: memoryview, deadline: float, peer: str) -> None:
    """Fill ``view`` from ``sock`` before ``deadline`` (time.monotonic)."""
    got = 0
    n = len(view)
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AFDPeerError(f"AFD peer {peer} did not answer within the timeout")
        try:
            sock.settimeout(remaining)
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise AFDPeerError(f"AFD peer {peer} did not answer within the timeout") from None
        except OSError as e:
            raise AFDPeerError(f"lost AFD peer {peer}: {e}") from e
        if k == 0:
            raise AFDPeerError(f"lost AFD peer {peer}: connection closed")
        got += k


def recv_bytes(sock: socket.socket, n: int, deadline: float, peer: str) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline, peer)
    return bytes(buf)


def send_all(sock: socket.socket, data, timeout: float, peer: str) -> None:
    """Send all of ``data`` within ``timeout`` seconds."""
    try:
        sock.settimeout(timeout)
        sock.sendall(data)
    except TimeoutError:
        raise AFDPeerError(f"AFD peer {peer} stopped reading (send timed out)") from None
    except OSError as e:
        raise AFDPeerError(f"lost AFD peer {peer}: {e}") from e


def recv_some(sock: socket.socket, view: memoryview, peer: str) -> int:
    """Read what ``sock`` holds now into ``view`` without waiting: the bytes read, 0
    when none are waiting. AFDPeerError at EOF or on a socket error."""
    if not len(view):
        return 0
    try:
        sock.settimeout(0.0)
        k = sock.recv_into(view, len(view))
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError as e:
        raise AFDPeerError(f"lost AFD peer {peer}: {e}") from e
    if k == 0:
        raise AFDPeerError(f"lost AFD peer {peer}: connection closed")
    return k


def send_some(sock: socket.socket, view: memoryview, peer: str) -> int:
    """Write what ``sock``'s buffer takes now of ``view`` without waiting: the bytes
    written (0 when it is full). AFDPeerError on a socket error."""
    if not len(view):
        return 0
    try:
        sock.settimeout(0.0)
        return sock.send(view)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError as e:
        raise AFDPeerError(f"lost AFD peer {peer}: {e}") from e


# ------------------------------------------------------------------ hello
def send_hello(sock: socket.socket, payload: dict, timeout: float, peer: str) -> None:
    send_all(sock, pack_hello(payload), timeout, peer)


def recv_hello(sock: socket.socket, deadline: float, peer: str) -> dict:
    """One hello frame (bounded size, scalar JSON); AFDProtocolError when it is not."""
    n = unpack_hello_preamble(recv_bytes(sock, HELLO_PREAMBLE.size, deadline, peer))
    return parse_hello(recv_bytes(sock, n, deadline, peer))


# ----------------------------------------------------------------- tensors
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor (no copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def send_tensor(sock: socket.socket, t: torch.Tensor, timeout: float, peer: str) -> None:
    """Device or non-contiguous tensors are staged through host memory."""
    host = t.contiguous() if t.device.type == "cpu" else t.contiguous().cpu()
    send_all(sock, tensor_bytes(host), timeout, peer)


def recv_tensor(sock: socket.socket, out: torch.Tensor, deadline: float, peer: str) -> None:
    if out.device.type == "cpu" and out.is_contiguous():
        recv_into(sock, tensor_bytes(out), deadline, peer)
        return
    staging = torch.empty(out.shape, dtype=out.dtype, device="cpu")
    recv_into(sock, tensor_bytes(staging), deadline, peer)
    out.copy_(staging)


# --------------------------------------------------------------- readiness
def readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets of ``socks`` with data (or EOF, or an error) to read, waiting
    up to ``timeout`` seconds. poll(2), so any descriptor number works (select
    refuses descriptors >= 1024, and vLLM raises the file limit well past that).
    A socket closed meanwhile (descriptor -1) is left out."""
    poller = select.poll()
    by_fd: dict[int, socket.socket] = {}
    for s in socks:
        fd = s.fileno()
        if fd >= 0:
            by_fd[fd] = s
            poller.register(fd, select.POLLIN | select.POLLPRI)
    if not by_fd:
        time.sleep(max(0.0, timeout))
        return []
    ready = []
    for fd, events in poller.poll(max(0, int(timeout * 1000))):
        if not events & select.POLLNVAL:  # POLLNVAL: closed under us
            ready.append(by_fd[fd])
    return ready


def socket_lost(sock: socket.socket) -> str | None:
    """Why the peer's ``sock`` is gone ("connection closed" at EOF, the error
    of a reset), None while it is open. Never blocks, and works for any
    descriptor number (poll(2) and a non-blocking peek; select() refuses
    descriptors >= 1024, which a process with more files open gets)."""
    try:
        if not readable([sock], 0):
            return None
        if sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK):
            return None  # data waiting, the connection is open
        return "connection closed"
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as e:
        return str(e)


def peer_closed(sock: socket.socket) -> bool:
    """The peer of ``sock`` closed its side or reset the connection, even with bytes of
    it still unread here (poll(2)'s POLLRDHUP, Linux). Never blocks, reads nothing."""
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    closed = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
    return any(ev & closed for _, ev in poller.poll(0))


def poll_io(
    wants: list[tuple[socket.socket, bool, bool]], timeout: float
) -> list[tuple[bool, bool]]:
    """For each (socket, read?, write?) of ``wants``: whether it can be read (data, EOF
    or an error) and written now, waiting up to ``timeout`` seconds for any of them.
    poll(2), as :func:`readable`; a socket closed meanwhile is neither."""
    poller = select.poll()
    fds = []
    for sock, read, write in wants:
        fd = sock.fileno()
        mask = (select.POLLIN | select.POLLPRI if read else 0) | (select.POLLOUT if write else 0)
        fds.append(fd if fd >= 0 and mask else -1)
        if fds[-1] >= 0:
            poller.register(fd, mask)
    if all(fd < 0 for fd in fds):
        time.sleep(max(0.0, timeout))
        return [(False, False)] * len(wants)
    events = {}
    for fd, ev in poller.poll(max(0, int(timeout * 1000))):
        events[fd] = ev
    broken = select.POLLERR | select.POLLHUP
    out = []
    for (_, read, write), fd in zip(wants, fds):
        ev = events.get(fd, 0) if fd >= 0 else 0
        if ev & select.POLLNVAL:  # closed under us
            ev = 0
        out.append((read and bool(ev & (select.POLLIN | select.POLLPRI | broken)),
                    write and bool(ev & (select.POLLOUT | broken))))  # fmt: skip
    return out


class Inbound:
    """One message expected from an attention rank, filled as its bytes arrive: the
    bytes of a host tensor (a layer input; staged through host memory for a device or
    non-contiguous ``out``, copied there by :meth:`finish`), or a control frame."""

    __slots__ = ("view", "got", "out", "staging", "is_control", "value", "check")

    def __init__(self, view: memoryview, out=None, staging=None, is_control: bool = False):
        self.view = view
        self.got = 0
        self.out = out
        self.staging = staging
        self.is_control = is_control
        self.value: Control | None = None  # a control frame's message, once it arrived
        # A message of a polled data plane (FFNPlane.polled), not of the byte stream:
        # check() says whether it arrived (and finished it); None for the stream's own.
        self.check: Callable[[], bool] | None = None

    @classmethod
    def tensor(cls, out: torch.Tensor) -> Inbound:
        if out.device.type == "cpu" and out.is_contiguous():
            return cls(tensor_bytes(out))
        staging = torch.empty(out.shape, dtype=out.dtype, device="cpu")
        return cls(tensor_bytes(staging), out, staging)

    @classmethod
    def control(cls) -> Inbound:
        return cls(memoryview(bytearray(CONTROL.size)), is_control=True)

    @classmethod
    def polled(cls, check: Callable[[], bool]) -> Inbound:
        """A message of a polled data plane: arrived once ``check()`` said so (one byte
        of bookkeeping stands for it)."""
        m = cls(memoryview(bytearray(1)))
        m.check = check
        return m

    def poll(self) -> bool:
        """A polled plane's message: True when it arrived just now."""
        if self.check is None or self.arrived or not self.check():
            return False
        self.got = 1
        return True

    @property
    def arrived(self) -> bool:
        return self.got == len(self.view)

    def rest(self) -> memoryview:
        return self.view[self.got :]

    def finish(self) -> None:
        if self.staging is not None:
            self.out.copy_(self.staging)


# ------------------------------------------------------------- the peer
class Peer:
    """An accepted attention rank, as its FFN rank sees it."""

    def __init__(self, rank: int, sock: socket.socket, addr: str):
        self.rank = rank
        self.sock = sock
        self.addr = addr
        self.last_seen = time.monotonic()
        self.last_step = 0.0  # when its last step arrived (batch window)
        self.name = f"attention rank {rank} at {addr}"
        self.last_step_id = -1
        # (step id, next micro-batch index, micro-batch count) of a DBO step
        # whose later micro-batches have not all arrived.
        self.open_step: tuple[int, int, int] | None = None
        # Non-blocking I/O of the FFN side (TCPFFNConnector.pump): the messages posted
        # for this rank's step, in wire order (taken by the FFN once they all arrived);
        # between steps the control frame being read; the bytes not yet sent, with the
        # tensors they belong to; when the last byte moved either way (or a wait began).
        self.rx: collections.deque[Inbound] = collections.deque()
        self.ctrl: Inbound | None = None
        self.tx: collections.deque[tuple[memoryview, object]] = collections.deque()
        # The sends of a polled data plane in flight: their done() checks, in order.
        self.sends: collections.deque[Callable[[], bool]] = collections.deque()
        self.progress = self.last_seen
        # A step-control message read but not handed out yet: nothing more is read
        # from this rank until it is (its next bytes are that step's data).
        self.held = False
        # A layer input of its step (or its router logits) taken by a data plane's
        # blocking receive, the layer's output not sent yet: it waits for this side
        # (it sends nothing meanwhile).
        self.awaits_output = False
        self.why: str | None = None  # why this session was lost

    def reading(self, between_steps: bool = True) -> Inbound | None:
        """The message this rank's next bytes belong to: the first posted one not yet
        arrived; between steps (nothing posted, no step held) a control frame, unless
        ``between_steps`` is False (a step is being served by blocking calls). None when
        its next bytes are not wanted yet."""
        for m in self.rx:
            if not m.arrived and m.check is None:  # a polled plane's message: not here
                return m
        if self.rx or self.held or not between_steps:
            return None
        if self.ctrl is None:
            self.ctrl = Inbound.control()
        return self.ctrl

    def owes(self) -> bool:
        """A message posted for this rank's step has not (wholly) arrived."""
        return any(not m.arrived for m in self.rx)

    def check_step(self, ctrl: Control) -> None:
        """Step ids of this peer must grow from step to step, and the
        micro-batches of one step share its id and come in index order; else
        the byte stream is out of step (AFDProtocolError)."""
        if ctrl.type != MSG_STEP:
            return
        index, count = ubatch_of(ctrl.flags)
        if self.open_step is not None:
            step_id, want, of = self.open_step
            if (ctrl.step_id, index, count) != (step_id, want, of):
                raise AFDProtocolError(
                    f"step {ctrl.step_id} micro-batch {index} of {count} while micro-batch "
                    f"{want} of {of} of step {step_id} was due"
                )
            self.open_step = None if want + 1 == of else (step_id, want + 1, of)
            return
        if index != 0:
            raise AFDProtocolError(
                f"step {ctrl.step_id} opened with micro-batch {index} of {count}"
            )
        if ctrl.step_id <= self.last_step_id:
            raise AFDProtocolError(
                f"step id {ctrl.step_id} after step {self.last_step_id} (step ids must grow)"
            )
        self.last_step_id = ctrl.step_id
        if count:
            self.open_step = (ctrl.step_id, 1, count)
