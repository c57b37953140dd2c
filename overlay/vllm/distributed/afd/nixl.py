# SPDX-License-Identifier: Apache-2.0
"""NIXL data plane for AFD (connector ``nixl``): one-sided writes into registered inboxes.

NIXL (``pip install nixl``) moves registered memory between agents with one-sided READs and
WRITEs and notifications, over whatever its backend (UCX by default: RDMA, TCP, shared
memory) finds between two hosts. The control channel (``vllm.distributed.afd.tcp``) keeps
the handshake, authentication, sessions, heartbeats, rejoin and failover; this plane only
moves the activations:

* Each role's process has one NIXL agent, named afresh at every start (a restarted FFN rank
  is a new agent: nothing keeps a registration of the old one).
* Right after the channel's authenticated handshake the attention rank sends its agent
  metadata, the address of its registered inbox and a session id over the channel's
  connection; the FFN rank registers an inbox for that session and answers the same. So an
  unauthenticated peer never learns an address, and a session's registrations end with it
  (``detach``).
* A message (one ``send``) is copied into a registered send slot and WRITten into slot
  ``seq % SLOTS`` of the peer's inbox with the notification ``"<session>:<seq>"``, and the
  sender drives the write to completion; the receiver waits for that notification (its own
  deadline), then copies the slot out. A
  step's messages in flight per direction never exceed 2 per micro-batch x
  ``max_ubatches`` (hidden states and router logits), below ``SLOTS``.
* Host copies into and out of the registered slots are plain memory copies (one thread):
  torch's intra-op threads, spinning in two processes on the same cores, turned a 128 KiB
  copy into milliseconds.
* Waits poll the agent (no progress thread: the waiting side drives its own progress),
  without sleeping for ``connector_extra_config.nixl_spin_us`` (default 2000) and then
  sleeping 0.2 ms between polls: a long spin gives the shortest hand-over where each role
  has cores of its own, a short one leaves the cores to the compute where roles share them.

Host memory (DRAM) on both sides in this release; device tensors are staged through it.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable

import torch

from vllm.afd.protocol import AFDHandshakeError, AFDPeerError
from vllm.distributed.afd.base import register_connector
from vllm.distributed.afd.channel import recv_hello, send_hello, tensor_bytes
from vllm.distributed.afd.plane import AttentionPlane, FFNPlane, Link
from vllm.distributed.afd.tcp import channel_connectors
from vllm.logger import init_logger

logger = init_logger(__name__)

# Inbox slots per session and direction (see the module docstring).
SLOTS = 8
ALIGN = 64
# A wait polls without sleeping for connector_extra_config.nixl_spin_us, then sleeps this
# long between polls (s).
SLEEP_S = 0.0002


def load_nixl():
    """nixl's agent API; ImportError naming the package when it is missing."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ImportError(
            "the AFD nixl connector needs NIXL: `pip install nixl` (this build pins "
            f"nixl==1.5.1) ({e})"
        ) from e
    return nixl_agent, nixl_agent_config


def plane_settings(ctx) -> tuple[str, float]:
    """(NIXL backend, seconds a wait polls before it sleeps) from connector_extra_config."""
    extra, spec = ctx.config.connector_extra_config, ctx.config.spec
    return spec.value(extra, "nixl_backend"), spec.value(extra, "nixl_spin_us") / 1e6


def slot_bytes(ctx) -> int:
    """One message's room: the largest step's hidden states (or float32 router logits,
    when the gate runs on the attention role, whichever is larger), aligned."""
    hidden = int(ctx.fingerprint["hidden_size"])
    dtype = getattr(torch, str(ctx.fingerprint["dtype"]))
    per_token = hidden * torch.empty((), dtype=dtype).element_size()
    if ctx.config.compute_gate_on_attention:
        per_token = max(per_token, 4 * int(ctx.num_router_logits or 0))
    n = ctx.max_num_tokens * per_token
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Agent:
    """One NIXL agent of this process, its notifications sorted by peer and session."""

    def __init__(self, role: str, rank: int, backend: str, spin_s: float = 0.002):
        nixl_agent, nixl_agent_config = load_nixl()
        self.spin_s = spin_s
        self.name = f"afd-{role}{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        config = nixl_agent_config(enable_prog_thread=False, backends=[backend])
        self.agent = nixl_agent(self.name, config)
        self.lock = threading.Lock()
        self._notes: dict[str, set[str]] = {}  # peer agent -> notifications not yet taken

    def metadata(self) -> str:
        with self.lock:
            return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def register(self, t: torch.Tensor):
        with self.lock:
            return self.agent.register_memory(t)

    def deregister(self, reg) -> None:
        with self.lock, contextlib.suppress(Exception):
            self.agent.deregister_memory(reg)

    def add_peer(self, metadata: str) -> str:
        with self.lock:
            name = self.agent.add_remote_agent(base64.b64decode(metadata))
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        with self.lock, contextlib.suppress(Exception):
            self.agent.remove_remote_agent(name)
        self._notes.pop(name, None)

    def write(self, src: torch.Tensor, peer: str, addr: int, note: str, who: str):
        """Post a WRITE of ``src`` (registered host memory) to ``addr`` of ``peer`` with
        notification ``note``; the handle is checked with ``done``."""
        with self.lock, self.peer_errors(who):
            local = self.agent.get_xfer_descs(src)
            remote = self.agent.get_xfer_descs([(addr, src.numel() * src.element_size(), 0)],
                                               "DRAM")
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer, note.encode())
            state = self.agent.transfer(handle)
        if state == "ERR":
            raise AFDPeerError(f"lost AFD peer {who}: posting a nixl write failed")
        return handle

    def done(self, handle, who: str) -> bool:
        with self.lock, self.peer_errors(who):
            state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                self.agent.release_xfer_handle(handle)
        if state == "ERR":
            raise AFDPeerError(f"lost AFD peer {who}: a nixl write failed")
        return state == "DONE"

    @staticmethod
    @contextlib.contextmanager
    def peer_errors(who: str):
        """NIXL's own errors of a transfer (a disconnected remote agent, a UCX failure)
        are the loss of the peer: an AFDPeerError naming it, which the channel's rejoin
        and failover handle like a closed connection."""
        try:
            yield
        except AFDPeerError:
            raise
        except Exception as e:  # noqa: BLE001 - the binding's error classes vary by build
            raise AFDPeerError(f"lost AFD peer {who}: nixl {type(e).__name__}: {e}") from e

    def poll(self, who: str) -> None:
        with self.lock, self.peer_errors(who):
            new = self.agent.get_new_notifs()
        for peer, notes in new.items():
            key = peer.decode() if isinstance(peer, bytes) else peer
            self._notes.setdefault(key, set()).update(
                n.decode() if isinstance(n, bytes) else n for n in notes
            )

    def take(self, peer: str, note: str) -> bool:
        got = self._notes.get(peer)
        if got is not None and note in got:
            got.discard(note)
            return True
        return False

    def wait_for(self, peer: str, note: str, deadline: float, who: str) -> None:
        start = time.monotonic()
        while True:
            if self.take(peer, note):
                return
            self.poll(who)
            if self.take(peer, note):
                return
            now = time.monotonic()
            if now >= deadline:
                raise AFDPeerError(f"AFD peer {who} did not answer within the timeout (nixl)")
            if now - start > self.spin_s:
                time.sleep(SLEEP_S)

    def wait_done(self, handle, deadline: float, who: str) -> None:
        start = time.monotonic()
        while not self.done(handle, who):
            now = time.monotonic()
            if now >= deadline:
                raise AFDPeerError(f"AFD nixl: a write to {who} did not complete in time")
            if now - start > self.spin_s:
                time.sleep(SLEEP_S)

    def close(self) -> None:
        agent, self.agent = self.agent, None
        del agent  # the agent's destructor releases its backend


class Mailbox:
    """One session's registered memory on one side: an inbox of SLOTS slots that the peer
    writes into, and send slots this side writes from."""

    def __init__(self, agent: Agent, slot: int):
        self.slot = slot
        self.inbox = torch.zeros(SLOTS * slot, dtype=torch.uint8)
        self.outbox = torch.zeros(SLOTS * slot, dtype=torch.uint8)
        self.regs = [agent.register(self.inbox), agent.register(self.outbox)]

    def address(self) -> int:
        return self.inbox.data_ptr()

    def release(self, agent: Agent) -> None:
        for reg in self.regs:
            agent.deregister(reg)
        self.regs = []


class Session:
    """What one side knows of a session with its peer."""

    def __init__(self, sid: str, peer_agent: str, peer_inbox: int, box: Mailbox, who: str):
        self.sid = sid
        self.peer_agent = peer_agent
        self.peer_inbox = peer_inbox
        self.box = box
        self.who = who
        self.sent = 0
        self.claimed = 0  # receives handed out (their sequence numbers)


def _view(box_bytes: torch.Tensor, slot: int, index: int, like: torch.Tensor) -> torch.Tensor:
    n = like.numel() * like.element_size()
    if n > slot:
        raise AFDPeerError(
            f"AFD nixl: a message of {n} bytes exceeds the inbox slot ({slot} bytes)"
        )
    start = index * slot
    return box_bytes[start:start + n]


def _send(agent: Agent, s: Session, x: torch.Tensor, timeout: float) -> None:
    """Write one message and drive the write to completion (the sender's agent makes its
    own progress: a posted write left alone may not leave this host)."""
    seq = s.sent
    index = seq % SLOTS
    host = x.contiguous() if x.device.type == "cpu" else x.contiguous().cpu()
    out = _view(s.box.outbox, s.box.slot, index, host)
    if out.numel():
        tensor_bytes(out)[:] = tensor_bytes(host)
    payload = out if out.numel() else s.box.outbox[index * s.box.slot:index * s.box.slot + 1]
    handle = agent.write(
        payload, s.peer_agent, s.peer_inbox + index * s.box.slot, f"{s.sid}:{seq}", s.who
    )
    s.sent += 1
    agent.wait_done(handle, time.monotonic() + timeout, s.who)


def _claim(s: Session) -> int:
    """The sequence number of the next message to receive (receives complete in the
    order they were claimed, whatever order they are waited for in)."""
    seq = s.claimed
    s.claimed += 1
    return seq


def _recv(agent: Agent, s: Session, seq: int, out: torch.Tensor, deadline: float) -> None:
    agent.wait_for(s.peer_agent, f"{s.sid}:{seq}", deadline, s.who)
    src = _view(s.box.inbox, s.box.slot, seq % SLOTS, out)
    if not out.numel():
        return
    if out.device.type == "cpu" and out.is_contiguous():
        tensor_bytes(out)[:] = tensor_bytes(src)
    else:
        out.copy_(src.view(out.dtype).view(out.shape))


def _hello(agent: Agent, box: Mailbox, **extra) -> dict:
    return {"nixl_agent": agent.name, "nixl_meta": agent.metadata(),
            "nixl_inbox": box.address(), "nixl_slot": box.slot, **extra}  # fmt: skip


def _peer_of(hello: dict, slot: int, who: str) -> tuple[str, str, int]:
    if hello.get("error"):
        raise AFDHandshakeError(f"AFD {who} refused the nixl data plane: {hello['error']}")
    meta, name, inbox = hello.get("nixl_meta"), hello.get("nixl_agent"), hello.get("nixl_inbox")
    if not (isinstance(meta, str) and isinstance(name, str) and isinstance(inbox, int)):
        raise AFDHandshakeError(f"AFD {who} sent no nixl agent (is it a nixl FFN server?)")
    if hello.get("nixl_slot") != slot:
        raise AFDHandshakeError(
            f"AFD {who}: nixl inbox slots differ ({hello.get('nixl_slot')} vs {slot} bytes): "
            "max_num_batched_tokens or the model differ"
        )
    return name, meta, inbox


# ------------------------------------------------------------------ attention side
class NixlAttentionPlane(AttentionPlane):
    dbo_capable = True

    def __init__(self, ctx):
        super().__init__(ctx)
        load_nixl()  # fail at start, naming the package
        self.backend, self.spin_s = plane_settings(ctx)
        self.slot = slot_bytes(ctx)
        self.agent: Agent | None = None
        self.box: Mailbox | None = None
        self.session: Session | None = None

    def connect(self, link: Link, deadline: float) -> object:
        if self.agent is None:
            self.agent = Agent("attention", self.ctx.rank, self.backend, self.spin_s)
            self.box = Mailbox(self.agent, self.slot)
        sid = secrets.token_hex(6)
        send_hello(link.sock, _hello(self.agent, self.box, session=sid), link.timeout, link.peer)
        name, meta, inbox = _peer_of(recv_hello(link.sock, deadline, link.peer), self.slot,
                                     link.peer)  # fmt: skip
        peer = self.agent.add_peer(meta)
        if peer != name:
            raise AFDHandshakeError(f"AFD {link.peer}: nixl agent {peer!r} is not {name!r}")
        return Session(sid, name, inbox, self.box, link.peer)

    def attach(self, link: Link, offer: object) -> None:
        super().attach(link, offer)
        if self.session is not None and self.session.peer_agent != offer.peer_agent:
            self.agent.remove_peer(self.session.peer_agent)
        self.session = offer

    def discard(self, offer: object) -> None:
        if offer is not None and (self.session is None
                                  or self.session.peer_agent != offer.peer_agent):
            self.agent.remove_peer(offer.peer_agent)

    def detach(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            self.agent.remove_peer(session.peer_agent)
        super().detach()

    def _live(self) -> tuple[Session, Link]:
        if self.session is None or self.link is None:
            raise AFDPeerError("AFD attention rank has no FFN session (nixl)")
        return self.session, self.link

    def send(self, x: torch.Tensor) -> None:
        s, link = self._live()
        _send(self.agent, s, x, link.timeout)

    def recv(self, out: torch.Tensor) -> torch.Tensor:
        s, link = self._live()
        _recv(self.agent, s, _claim(s), out, time.monotonic() + link.timeout)
        return out

    def recv_start(self, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """DBO: the FFN rank writes the reply into the inbox whenever it is ready (nothing
        to drain, unlike a socket); ``wait()`` takes the reply this call claimed."""
        s, link = self._live()
        seq, timeout = _claim(s), link.timeout

        def wait() -> torch.Tensor:
            _recv(self.agent, s, seq, out, time.monotonic() + timeout)
            return out

        return wait

    def close(self) -> None:
        self.detach()
        if self.box is not None:
            self.box.release(self.agent)
            self.box = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None


# ------------------------------------------------------------------ FFN side
class NixlFFNPlane(FFNPlane):
    dbo_capable = True

    def __init__(self, ctx):
        super().__init__(ctx)
        load_nixl()
        backend, spin_s = plane_settings(ctx)
        self.slot = slot_bytes(ctx)
        self.agent = Agent("ffn", ctx.rank, backend, spin_s)
        self.sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        logger.info("AFD: FFN rank %d nixl agent %s (backend %s, %d-byte slots)",
                    ctx.rank, self.agent.name, backend, self.slot)  # fmt: skip

    def attach(self, link: Link, deadline: float) -> None:
        hello = recv_hello(link.sock, deadline, link.peer)
        sid = hello.get("session")
        try:
            name, meta, inbox = _peer_of(hello, self.slot, link.peer)
            if not isinstance(sid, str) or not sid:
                raise AFDHandshakeError(f"AFD {link.peer} sent no nixl session id")
        except AFDHandshakeError as e:
            send_hello(link.sock, {"error": str(e)}, link.timeout, link.peer)
            raise
        box = Mailbox(self.agent, self.slot)
        try:
            peer = self.agent.add_peer(meta)
            send_hello(link.sock, _hello(self.agent, box), link.timeout, link.peer)
        except BaseException:
            box.release(self.agent)
            raise
        with self._lock:
            old = self.sessions.pop(link.rank, None)
            self.sessions[link.rank] = Session(sid, peer, inbox, box, link.peer)
        if old is not None:
            self._end(old)

    def _end(self, s: Session) -> None:
        if all(x.peer_agent != s.peer_agent for x in self.sessions.values()):
            self.agent.remove_peer(s.peer_agent)
        s.box.release(self.agent)

    def detach(self, link: Link) -> None:
        with self._lock:
            s = self.sessions.pop(link.rank, None)
        if s is not None:
            self._end(s)

    def _session(self, link: Link) -> Session:
        s = self.sessions.get(link.rank)
        if s is None:
            raise AFDPeerError(f"lost AFD {link.peer}: no nixl session")
        return s

    def recv(self, link: Link, out: torch.Tensor) -> None:
        s = self._session(link)
        _recv(self.agent, s, _claim(s), out, time.monotonic() + link.timeout)

    def send(self, link: Link, y: torch.Tensor) -> None:
        _send(self.agent, self._session(link), y, link.timeout)

    def close(self) -> None:
        with self._lock:
            sessions, self.sessions = list(self.sessions.values()), {}
        for s in sessions:
            self._end(s)
        self.agent.close()


NixlAttentionConnector, NixlFFNConnector = channel_connectors(
    NixlAttentionPlane, NixlFFNPlane, "Nixl"
)
register_connector("nixl", NixlAttentionConnector, NixlFFNConnector)
