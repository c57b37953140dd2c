# SPDX-License-Identifier: Apache-2.0
"""Framed socket primitives of the AFD connectors (``tcp``, ``cuda_ipc``, ``nccl``).

Every read has a deadline and every send a timeout; a closed, reset or silent
peer becomes an :class:`~vllm.afd.protocol.AFDPeerError` naming it. Messages
are the hello frames and control structs of ``vllm.afd.protocol`` and raw
tensor bytes whose size the receiver already knows.
"""

from __future__ import annotations

import select
import socket
import time

import torch

from vllm.afd.protocol import (
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
