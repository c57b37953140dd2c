# SPDX-License-Identifier: Apache-2.0
"""TCP connector for AFD on the CPU (registered as ``gloo``, alias ``tcp``).

Plain sockets rather than a torch Gloo process group: every read has a
deadline, a dead peer shows up as EOF/reset at once, sizes are bounded, and a
stranger on the port is dropped without touching the running deployment.

Rank layout: FFN rank ``f`` listens on ``host:port+f`` and serves attention
ranks ``f*k .. f*k+k-1`` with ``k = num_attention_ranks / num_ffn_ranks``.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import os
import select
import socket
import threading
import time
from collections.abc import Callable

import torch

from vllm.afd import metrics
from vllm.afd.protocol import (
    CONTROL,
    HELLO_PREAMBLE,
    MSG_GOODBYE,
    MSG_HEARTBEAT,
    MSG_PROFILE,
    MSG_STEP,
    AFDHandshakeError,
    AFDPeerError,
    AFDProtocolError,
    Control,
    fingerprint_mismatch,
    pack_hello,
    parse_hello,
    ubatch_flags,
    unpack_hello_preamble,
)
from vllm.distributed.afd.base import (
    AttentionConnector,
    ConnectorContext,
    FFNConnector,
    StepPeer,
    register_connector,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


def _secret(ctx: ConnectorContext) -> str | None:
    env = ctx.config.connector_extra_config.get("secret_env", "VLLM_AFD_SECRET")
    return os.environ.get(env) or None


def _recv_exact_into(sock: socket.socket, view: memoryview, deadline: float, peer: str) -> None:
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


def _recv_bytes(sock: socket.socket, n: int, deadline: float, peer: str) -> bytes:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf), deadline, peer)
    return bytes(buf)


def _tensor_view(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _host(t: torch.Tensor) -> torch.Tensor:
    """Bytes to send: device tensors are staged through host memory."""
    return t.contiguous() if t.device.type == "cpu" else t.contiguous().cpu()


def _recv_tensor(sock, out: torch.Tensor, deadline: float, peer: str) -> None:
    if out.device.type == "cpu" and out.is_contiguous():
        _recv_exact_into(sock, _tensor_view(out), deadline, peer)
        return
    staging = torch.empty(out.shape, dtype=out.dtype, device="cpu")
    _recv_exact_into(sock, _tensor_view(staging), deadline, peer)
    out.copy_(staging)


def _send_all(sock: socket.socket, data, timeout: float, peer: str) -> None:
    try:
        sock.settimeout(timeout)
        sock.sendall(data)
    except TimeoutError:
        raise AFDPeerError(f"AFD peer {peer} stopped reading (send timed out)") from None
    except OSError as e:
        raise AFDPeerError(f"lost AFD peer {peer}: {e}") from e


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


def _auth_token(secret: str | None, payload: dict) -> str:
    if not secret:
        return ""
    msg = f"{payload['role']}:{payload['rank']}:{payload['afd_revision']}".encode()
    return hmac.new(secret.encode(), msg, "sha256").hexdigest()


class TCPAttentionConnector(AttentionConnector):
    dbo_capable = True

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        cfg = ctx.config
        self.ffn_rank = cfg.ffn_rank_of(ctx.rank)
        self.addr = (cfg.host, cfg.ffn_port(self.ffn_rank))
        self.peer = f"FFN rank {self.ffn_rank} at {cfg.host}:{self.addr[1]}"
        self.timeout = float(cfg.timeout_s)
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._in_step = False
        self._dead: str | None = None
        self._closed = threading.Event()
        self._hb: threading.Thread | None = None
        # Background receives (recv_start): one worker, so they complete in order.
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._rsock: socket.socket | None = None

    # -- connection ------------------------------------------------------
    def connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        last_err: Exception | None = None
        logger.info("AFD: connecting to %s (timeout %.0f s)", self.peer, self.timeout)
        while True:
            try:
                sock = socket.create_connection(self.addr, timeout=min(5.0, self.timeout))
                if _self_connected(sock):
                    # Nothing listens yet and the kernel picked the FFN's own port as
                    # this socket's source port (possible when that port lies in the
                    # ephemeral range): the socket is connected to itself and holds
                    # the port the FFN rank is about to bind. Free it and retry.
                    sock.close()
                    raise ConnectionRefusedError(
                        "connection to itself (nothing listening on the FFN port yet)"
                    )
                break
            except OSError as e:
                last_err = e
                if time.monotonic() >= deadline:
                    raise AFDPeerError(
                        f"could not reach AFD {self.peer} within timeout_s={self.timeout:g}: "
                        f"{last_err}. Check that the FFN server is started with the same "
                        "--afd-config, that host/port are right and reachable."
                    ) from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._handshake(sock, deadline)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._hb = threading.Thread(target=self._heartbeat_loop, name="afd-heartbeat", daemon=True)
        self._hb.start()
        logger.info("AFD: attention rank %d connected to %s", self.ctx.rank, self.peer)

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        local = _hello_payload(self.ctx, "attention")
        local["auth"] = _auth_token(_secret(self.ctx), local)
        _send_all(sock, pack_hello(local), self.timeout, self.peer)
        hello_deadline = max(deadline, time.monotonic() + 10.0)
        try:
            n = unpack_hello_preamble(
                _recv_bytes(sock, HELLO_PREAMBLE.size, hello_deadline, self.peer)
            )
            remote = parse_hello(_recv_bytes(sock, n, hello_deadline, self.peer))
        except AFDPeerError as e:
            raise AFDPeerError(
                f"{e} (during the AFD handshake, before any reply: is what listens there "
                "an AFD FFN server of this build?)"
            ) from None
        status = remote.get("status")
        if status != "ok":
            raise AFDHandshakeError(f"AFD {self.peer} refused this attention rank: {status}")
        mismatch = fingerprint_mismatch(local, remote)
        if mismatch:
            raise AFDHandshakeError(f"{mismatch} ({self.peer})")

    def _heartbeat_loop(self) -> None:
        interval = min(1.0, self.timeout / 4)
        msg = Control(MSG_HEARTBEAT).pack()
        while not self._closed.wait(interval):
            with self._lock:
                if self._in_step or self.sock is None or self._dead:
                    continue
                try:
                    _send_all(self.sock, msg, self.timeout, self.peer)
                except AFDPeerError as e:
                    self._dead = str(e)
                    logger.error("AFD: %s", e)

    def _check(self) -> socket.socket:
        if self._dead:
            raise AFDPeerError(self._dead)
        if self.sock is None:
            raise AFDPeerError(f"AFD attention rank is not connected to {self.peer}")
        return self.sock

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
        counts of the others, ``ubatch_tokens``, are not needed)."""
        flags = ubatch_flags(*ubatch) if ubatch is not None else 0
        with self._lock:
            sock = self._check()
            self._in_step = True
            self._send(sock, Control(MSG_STEP, step_id, num_tokens, flags).pack())

    def _send(self, sock, data) -> None:
        try:
            _send_all(sock, data, self.timeout, self.peer)
        except AFDPeerError as e:
            self._dead = str(e)
            raise

    def send(self, x: torch.Tensor) -> None:
        self._send(self._check(), _tensor_view(_host(x)))

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        sock = self._check()
        try:
            _recv_tensor(sock, out, time.monotonic() + self.timeout, self.peer)
        except AFDPeerError as e:
            self._dead = str(e)
            raise
        return out

    def recv_start(self, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start receiving ``out`` in the background, after the receives started
        before it; the returned ``wait()`` gives it (bounded by timeout_s).

        DBO: a micro-batch starts its receive before it yields, so the FFN rank's
        reply drains while the other micro-batch sends (with both sides blocked
        in sends of messages larger than the socket buffers, neither would read).
        """
        sock = self._check()
        if self._reader is None:
            # Own socket object (same connection): its timeout is its own.
            self._rsock = sock.dup()
            self._reader = concurrent.futures.ThreadPoolExecutor(1, "afd-recv")
        rsock, timeout, peer = self._rsock, self.timeout, self.peer

        def job() -> torch.Tensor:
            _recv_tensor(rsock, out, time.monotonic() + timeout, peer)
            return out

        future = self._reader.submit(job)

        def wait() -> torch.Tensor:
            try:
                return future.result(timeout + 5.0)
            except concurrent.futures.TimeoutError:
                err = AFDPeerError(f"AFD peer {peer} did not answer within the timeout")
            except AFDPeerError as e:
                err = e
            self._dead = str(err)
            raise err

        return wait

    def end_step(self) -> None:
        with self._lock:
            self._in_step = False

    def is_up(self) -> bool:
        return self.sock is not None and not self._dead

    def profile(self, is_start: bool) -> None:
        with self._lock:
            sock = self._check()
            self._send(sock, Control(MSG_PROFILE, flags=int(is_start)).pack())
        logger.info("AFD: asked %s to %s its profiler", self.peer, "start" if is_start else "stop")

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self.sock is not None:
                if not self._dead and not self._in_step:
                    try:
                        _send_all(self.sock, Control(MSG_GOODBYE).pack(), 2.0, self.peer)
                    except AFDPeerError:
                        pass
                if self._rsock is not None:
                    try:  # ends a background receive at once (EOF), not at its deadline
                        self.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self.sock.close()
                self.sock = None
            if self._reader is not None:
                self._reader.shutdown(wait=False, cancel_futures=True)
                self._reader = None
            if self._rsock is not None:
                self._rsock.close()
                self._rsock = None


class _Peer:
    def __init__(self, rank: int, sock: socket.socket, addr: str):
        self.rank = rank
        self.sock = sock
        self.addr = addr
        self.last_seen = time.monotonic()
        self.last_step = 0.0
        self.name = f"attention rank {rank} at {addr}"


class TCPFFNConnector(FFNConnector):
    dbo_capable = True
    # A rank that had a step within ACTIVE_S is waited for (up to the batch
    # window, connector_extra_config.batch_window_ms, default 5) to join a step.
    ACTIVE_S = 1.0

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        cfg = ctx.config
        self.batch_window = float(cfg.connector_extra_config.get("batch_window_ms", 5.0)) / 1e3
        self.expected = set(cfg.attention_ranks_of(ctx.rank))
        self.addr = (cfg.host, cfg.ffn_port(ctx.rank))
        self.timeout = float(cfg.timeout_s)
        self.listener: socket.socket | None = None
        self.peers: dict[int, _Peer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started_at = 0.0
        self._ever_complete = False
        self._last_refusal: str | None = None  # named in the start-up timeout error
        self._accept_thread: threading.Thread | None = None
        self._profile_requests: list[bool] = []

    def start(self) -> None:
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

    # -- accepting ---------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self.listener is not None
        try:
            self.listener.settimeout(0.5)
        except OSError:  # closed before this thread ran
            return
        while not self._stop.is_set():
            try:
                sock, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            # Handshake in its own thread so that a silent stranger cannot
            # hold up other peers.
            threading.Thread(
                target=self._handshake, args=(sock, f"{addr[0]}:{addr[1]}"), daemon=True
            ).start()

    def _reply(self, sock: socket.socket, status: str) -> None:
        payload = _hello_payload(self.ctx, "ffn")
        payload["status"] = status
        try:
            _send_all(sock, pack_hello(payload), 5.0, "new peer")
        except AFDPeerError:
            pass

    def _handshake(self, sock: socket.socket, addr: str) -> None:
        try:
            accepted = self._handshake_or_drop(sock, addr)
        except Exception as e:  # noqa: BLE001 - a stranger must never kill this thread
            logger.warning("AFD: dropped connection from %s: %s", addr, e)
            sock.close()
            accepted = False
        if not accepted:
            metrics.STATS.inc("handshake_failures")

    def _handshake_or_drop(self, sock: socket.socket, addr: str) -> bool:
        """True when the peer was accepted; otherwise the connection is closed."""
        deadline = time.monotonic() + min(10.0, self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            n = unpack_hello_preamble(_recv_bytes(sock, HELLO_PREAMBLE.size, deadline, addr))
            remote = parse_hello(_recv_bytes(sock, n, deadline, addr))
        except (AFDPeerError, AFDProtocolError) as e:
            logger.warning("AFD: dropped connection from %s: %s", addr, e)
            sock.close()  # not this protocol: no answer
            return False
        role, rank = remote.get("role"), remote.get("rank")
        if (
            not isinstance(role, str)
            or not isinstance(rank, int)
            or isinstance(rank, bool)
            or not isinstance(remote.get("afd_revision"), str)
        ):
            logger.warning("AFD: refused %s: hello lacks role/rank/afd_revision", addr)
            self._reply(
                sock, "refused: hello lacks a string role, an integer rank and afd_revision"
            )
            sock.close()
            return False
        secret = _secret(self.ctx)
        if secret and not hmac.compare_digest(
            str(remote.get("auth", "")), _auth_token(secret, remote)
        ):
            logger.warning("AFD: dropped connection from %s: bad shared secret", addr)
            self._reply(sock, "authentication failed (shared secret differs)")
            sock.close()
            return False
        local = _hello_payload(self.ctx, "ffn")
        mismatch = fingerprint_mismatch(local, remote)
        if mismatch is None and remote.get("role") != "attention":
            mismatch = f"peer role is {remote.get('role')!r}, expected 'attention'"
        if mismatch is None and rank not in self.expected:
            mismatch = (
                f"attention rank {rank!r} is not served by FFN rank {self.ctx.rank} "
                f"(it serves {sorted(self.expected)})"
            )
        if mismatch:
            self._reply(sock, mismatch)
            sock.close()
            # The attention rank ends on this reply. This rank does not: a hello
            # is not proof of anything (without a shared secret anyone can send
            # one), so it keeps serving its peers or waiting for the right ones;
            # if those never come, the start-up timeout error names this refusal.
            self._last_refusal = f"{mismatch} (peer {addr})"
            logger.error("AFD: refused attention hello: %s", self._last_refusal)
            return False
        with self._lock:
            if rank in self.peers:
                self._reply(sock, f"attention rank {rank} is already connected")
                sock.close()
                return False
            self._reply(sock, "ok")
            try:
                self._accept_device(rank, sock, addr)
            except Exception as e:  # noqa: BLE001 - this peer is refused, serving goes on
                logger.error(
                    "AFD: attention rank %d from %s: device channel failed: %s", rank, addr, e
                )
                sock.close()
                return False
            self.peers[rank] = _Peer(rank, sock, addr)
            if set(self.peers) == self.expected:
                self._ever_complete = True
        logger.info(
            "AFD: FFN rank %d accepted attention rank %d from %s", self.ctx.rank, rank, addr
        )
        return True

    def _accept_device(self, rank: int, sock: socket.socket, addr: str) -> None:
        """After an accepted hello: set up a device data path (none here)."""

    # -- serving -------------------------------------------------------------
    def wait_step(self, timeout: float) -> list[StepPeer]:
        with self._lock:
            peers = list(self.peers.values())
            complete = self._ever_complete
        now = time.monotonic()
        if not complete and now - self._started_at > self.timeout:
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
            waiting = [p for p in peers if p.rank not in got and now - p.last_step < self.ACTIVE_S]
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
        return ready

    def _poll(self, peers: list[_Peer], timeout: float) -> list[StepPeer]:
        # Peers that said goodbye meanwhile are gone (their sockets closed).
        peers = [p for p in peers if self.peers.get(p.rank) is p]
        if not peers:
            time.sleep(min(timeout, 0.05))
            return []
        return self._read_sockets(peers, timeout)

    def _read_sockets(self, peers: list[_Peer], timeout: float) -> list[StepPeer]:
        """Control messages waiting on the peers' sockets (up to ``timeout``);
        raises for a peer silent for timeout_s."""
        try:
            readable, _, _ = select.select([p.sock for p in peers], [], [], timeout)
        except (OSError, ValueError):  # a socket closed under us: look again next time
            return []
        ready: list[StepPeer] = []
        for p in peers:
            if p.sock in readable:
                ctrl = self._read_control(p)
                if ctrl is None:
                    continue
                ready.append(StepPeer(p.rank, ctrl))
            elif time.monotonic() - p.last_seen > self.timeout:
                self._drop(p)
                raise AFDPeerError(f"lost AFD {p.name}: nothing received for {self.timeout:g} s")
        return ready

    def _read_control(self, p: _Peer) -> Control | None:
        data = _recv_bytes(p.sock, CONTROL.size, time.monotonic() + self.timeout, p.name)
        try:
            ctrl = Control.unpack(data, self.ctx.max_num_tokens)
        except AFDProtocolError as e:
            self._drop(p)
            raise AFDPeerError(f"AFD {p.name} broke the protocol: {e}") from e
        p.last_seen = time.monotonic()
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

    def recv_control(self, peer: StepPeer) -> Control:
        """The next step-control message of this peer, within timeout_s (a later
        micro-batch of the step being served)."""
        p = self._peer(peer)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            ctrl = self._read_control(p)
            if ctrl is not None:
                return ctrl
            if self.peers.get(p.rank) is not p:
                break
        raise AFDPeerError(f"lost AFD {p.name} during a micro-batched step")

    def take_profile_requests(self) -> list[bool]:
        with self._lock:
            requests, self._profile_requests = self._profile_requests, []
        return requests

    def peer_states(self) -> dict[str, bool]:
        with self._lock:
            connected = set(self.peers)
        return {f"attention_rank_{r}": r in connected for r in sorted(self.expected)}

    def _drop(self, p: _Peer) -> None:
        with self._lock:
            if self.peers.get(p.rank) is p:
                del self.peers[p.rank]
        try:
            p.sock.close()
        except OSError:
            pass

    def _peer(self, step_peer: StepPeer) -> _Peer:
        p = self.peers.get(step_peer.rank)
        if p is None:
            raise AFDPeerError(f"lost AFD attention rank {step_peer.rank} during a step")
        return p

    def recv(self, peer: StepPeer, out: torch.Tensor) -> None:
        p = self._peer(peer)
        _recv_tensor(p.sock, out, time.monotonic() + self.timeout, p.name)
        p.last_seen = time.monotonic()

    def send(self, peer: StepPeer, y: torch.Tensor) -> None:
        p = self._peer(peer)
        _send_all(p.sock, _tensor_view(_host(y)), self.timeout, p.name)

    def close(self) -> None:
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


register_connector("gloo", TCPAttentionConnector, TCPFFNConnector)
