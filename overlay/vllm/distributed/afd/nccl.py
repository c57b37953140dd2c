# SPDX-License-Identifier: Apache-2.0
"""NCCL connector for AFD on GPUs (``nccl``, alias ``P2pNcclAFDConnector``): the control
channel (``vllm.distributed.afd.tcp``) composed with the NCCL data plane.

Activations, and the step's control message, travel by NCCL point-to-point (vLLM's
PyNccl) on the current CUDA stream: a layer exchange needs no host synchronisation and
the attention role's CUDA graphs capture it, step control included (a graph replay sends
its step's control message itself).

One communicator per attention-FFN session, of two members: the FFN rank is member 0,
the attention rank member 1. It is formed right after the channel's handshake: the FFN
side makes the NCCL unique id and sends it over the session's connection (authenticated
by the channel; no rendezvous store, no port of its own), then both sides initialise
the communicator. Every FFN rank has its own sessions, so any number of FFN ranks. A
session that ends (a lost peer, a goodbye) has its communicator aborted; a restarted
peer re-handshakes with the channel and gets a new communicator (the FFN rank's graphs
of the old one are dropped: ``generation``).

The FFN rank posts each session's next control receive on a stream of that session's
own and polls its completion (``FFNPlane.polls_steps``): a silent attention rank holds
no other rank's steps.

Losses (not yet run on GPUs; the unit tests drive the plane with a fake communicator):
an NCCL operation waiting on a lost peer is not bounded by ``timeout_s``; the channel's
loss of the peer (EOF, heartbeat silence) aborts the session's communicator, which ends
its pending operations. The attention rank re-runs the interrupted forward whole after
a rejoin (``reruns_forward``; every forward is waited for and checked) while it has
captured no CUDA graph of the exchange: a captured graph holds the communicator it was
captured with, so once one is captured a lost FFN rank ends the engine, naming the loss.
On the FFN side the serve thread may wait on the device for a pass: a watch thread
aborts the communicator of a session whose connection the peer closed or reset (a killed
attention server) within 0.1 s; a rank that stops (SIGSTOP) in the middle of a pass can
hold that pass until it goes on (not bounded by ``timeout_s``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from vllm.afd.protocol import MSG_STEP, AFDHandshakeError, AFDPeerError, Control
from vllm.distributed.afd.base import ConnectorContext, register_connector
from vllm.distributed.afd.channel import peer_closed, recv_hello, send_hello
from vllm.distributed.afd.plane import AttentionPlane, FFNPlane, Link
from vllm.distributed.afd.tcp import channel_connectors
from vllm.logger import init_logger

logger = init_logger(__name__)

FFN_MEMBER, ATTENTION_MEMBER = 0, 1
# The FFN rank's check of its sessions' connections (a peer that closed or reset it).
WATCH_S = 0.1
# The step's control message on the device: [num_tokens, flags] (int64).
CONTROL_WORDS = 2
UNIQUE_ID_KEY = "nccl_unique_id"


def _unique_id_type():
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    return ncclUniqueId


class LinkGroup:
    """What PyNccl's communicator asks of its group (``rank``, ``world_size``,
    ``broadcast_obj`` of the NCCL unique id from member 0), over one session's
    connection: member 0 (the FFN rank) sends the id's bytes, member 1 reads them."""

    world_size = 2

    def __init__(self, rank: int, link: Link, deadline: float):
        self.rank, self.link, self.deadline = rank, link, deadline

    def broadcast_obj(self, obj, src: int):
        link = self.link
        if self.rank == src:
            send_hello(link.sock, {UNIQUE_ID_KEY: bytes(obj.internal).hex()}, link.timeout,
                       link.peer)  # fmt: skip
            return obj
        text = recv_hello(link.sock, self.deadline, link.peer).get(UNIQUE_ID_KEY)
        uid = _unique_id_type()()
        try:
            raw = bytes.fromhex(text) if isinstance(text, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != len(uid.internal):
            raise AFDHandshakeError(
                f"AFD {link.peer} sent no NCCL unique id of {len(uid.internal)} bytes "
                "(is it an nccl FFN server of this build?)"
            )
        for i, byte in enumerate(raw):
            uid.internal[i] = byte
        return uid


def _pynccl(group: LinkGroup, device: torch.device):
    """vLLM's PyNccl communicator over ``group`` (a stateless group: PyNccl takes the
    unique id from ``group.broadcast_obj``)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    class _Group(StatelessProcessGroup):
        pass

    # PyNccl checks for a StatelessProcessGroup; only rank, world_size and broadcast_obj
    # are used (the store is not).
    stateless = _Group(rank=group.rank, world_size=group.world_size, store=None)
    stateless.broadcast_obj = group.broadcast_obj
    return PyNcclCommunicator(stateless, device=device)


# The communicator factory: (LinkGroup, device) -> a PyNccl communicator (send, recv,
# destroy, disabled). Tests put a fake here.
make_comm = _pynccl


def _form(ctx: ConnectorContext, member: int, link: Link, deadline: float):
    comm = make_comm(LinkGroup(member, link, deadline), indexed(ctx.device))
    if getattr(comm, "disabled", False):
        raise RuntimeError("AFD nccl connector: PyNccl is disabled on this device")
    return comm


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index (vLLM's device config says "cuda" without one)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _abort(comm) -> None:
    """End ``comm`` and its pending operations, in the background: an abort may wait
    for CUDA graphs that captured the communicator to be destroyed."""
    if comm is None or getattr(comm, "aborted", False):
        return
    comm.aborted = True
    threading.Thread(target=comm.destroy, name="afd-nccl-abort", daemon=True).start()


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------ attention side
class NCCLAttentionPlane(AttentionPlane):
    """Member 1 of its session's communicator: the step's control message and each
    layer's activations sent, the replies received, on the current stream."""

    graph_capable = True
    dbo_capable = False
    carries_control = True
    # NCCL operations run on the device after the host moved on: a forward during which
    # the FFN rank was lost is re-run whole after the rejoin (every forward is checked).
    reruns_forward = True

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.comm = None
        self.control: torch.Tensor | None = None
        self.loss: str | None = None  # why the session's operations failed (lost)
        self.sessions = 0  # communicators formed (one per session)
        self.captured = False  # a CUDA graph holds this rank's communicator

    @property
    def rejoins(self) -> bool:
        """A new communicator serves a rejoined FFN rank, but a captured graph holds
        the one it was captured with: no rejoin once one is captured."""
        return not self.captured

    def connect(self, link: Link, deadline: float) -> object:
        """A new communicator with the FFN rank of this session (first connect, rejoin)."""
        return _form(self.ctx, ATTENTION_MEMBER, link, deadline)

    def attach(self, link: Link, offer: object) -> None:
        super().attach(link, offer)
        _abort(self.comm)
        self.comm, self.loss = offer, None
        if self.control is None:
            self.control = torch.zeros(CONTROL_WORDS, dtype=torch.int64,
                                       device=indexed(self.ctx.device))  # fmt: skip
        self.sessions += 1
        logger.info("AFD: NCCL communicator with %s formed (session %d)", link.peer,
                    self.sessions)  # fmt: skip

    def discard(self, offer: object) -> None:
        _abort(offer)

    def detach(self) -> None:
        comm, self.comm = self.comm, None
        _abort(comm)
        super().detach()

    def lost(self, why: str) -> None:
        """The channel found the FFN rank lost: its communicator is aborted, so that
        operations waiting on it end (the forward's check names the loss)."""
        self.loss = why
        _abort(self.comm)

    def _live(self):
        if self.comm is None:
            raise AFDPeerError("AFD attention rank has no FFN session (nccl)")
        return self.comm

    def begin_step(self, num_tokens: int, flags: int) -> None:
        """The step's control message, device work on the current stream (a captured
        graph replays it with the graph's own token count)."""
        comm = self._live()
        self.control[0].fill_(num_tokens)
        self.control[1].fill_(flags)
        self._note_capture(self.control)
        comm.send(self.control, dst=FFN_MEMBER)

    def send(self, x: torch.Tensor, lane: int = 0) -> None:
        comm = self._live()
        self._note_capture(x)
        comm.send(x.contiguous(), dst=FFN_MEMBER)

    def recv(self, out: torch.Tensor, lane: int = 0) -> torch.Tensor:
        comm = self._live()
        self._note_capture(out)
        comm.recv(out, src=FFN_MEMBER)
        return out

    def _note_capture(self, t: torch.Tensor) -> None:
        if not self.captured and _capturing(t):
            self.captured = True
            logger.info("AFD: a CUDA graph captured the NCCL exchange: a lost FFN rank "
                        "now ends the engine (the graph holds this communicator)")  # fmt: skip

    def step_lost(self) -> str | None:
        """After a forward (its device work waited for): the loss that aborted its
        operations, None when there was none."""
        if self.ctx.device.type == "cuda":
            torch.cuda.current_stream(indexed(self.ctx.device)).synchronize()
        return self.loss

    def close(self) -> None:
        self.detach()


# ------------------------------------------------------------------ FFN side
@dataclass
class Session:
    """One attention rank's session on the FFN rank: its communicator, the device
    buffer and stream of its control receives, the receive posted (its event)."""

    comm: object
    control: torch.Tensor
    stream: object
    pending: object = None  # the event of the control receive posted, None if none
    seq: int = 0  # control messages taken
    sock: object = None  # the session's connection (the watch thread's check)


class NCCLFFNPlane(FFNPlane):
    """Member 0 of each session's communicator. The control message of a session's next
    step is received on that session's own stream and its completion polled: no
    session's wait holds another's."""

    graph_capable = True
    dbo_capable = False
    polls_steps = True

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self.generation = 0
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> None:
        """The watch thread: the serve thread may wait on the device for a pass (a
        receive from a rank that died holds it), and the channel then reads no
        connection; a session whose peer closed or reset its connection has its
        communicator aborted here, which ends that wait."""
        self._watch = threading.Thread(target=self._watch_loop, name="afd-nccl-watch",
                                       daemon=True)  # fmt: skip
        self._watch.start()

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_S):
            with self._lock:
                sessions = list(self.sessions.values())
            for s in sessions:
                if s.sock is not None and peer_closed(s.sock):
                    _abort(s.comm)

    def attach(self, link: Link, deadline: float) -> None:
        """A new communicator for this session (handshake thread): a rank that joins
        again (its server restarted) gets a new one, the old one is aborted."""
        comm = _form(self.ctx, FFN_MEMBER, link, deadline)
        dev = indexed(self.ctx.device)
        stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        session = Session(comm, torch.zeros(CONTROL_WORDS, dtype=torch.int64, device=dev),
                          stream, sock=link.sock)  # fmt: skip
        with self._lock:
            old = self.sessions.pop(link.rank, None)
            self.sessions[link.rank] = session
            self.generation += 1  # graphs of the old communicator are dropped
        if old is not None:
            _abort(old.comm)
        logger.info("AFD: NCCL communicator with %s formed", link.peer)

    def detach(self, link: Link) -> None:
        with self._lock:
            s = self.sessions.pop(link.rank, None)
        if s is not None:
            _abort(s.comm)

    def release(self, link: Link | None) -> None:
        """A lost session (None: every one): abort its communicator, so that operations
        waiting on the lost rank end."""
        with self._lock:
            sessions = list(self.sessions.values()) if link is None else (
                [self.sessions[link.rank]] if link.rank in self.sessions else [])  # fmt: skip
        for s in sessions:
            _abort(s.comm)

    def _session(self, rank: int, name: str) -> Session:
        s = self.sessions.get(rank)
        if s is None:
            raise AFDPeerError(f"lost AFD {name}: no NCCL session")
        return s

    def poll_steps(self, sessions: list[tuple[int, str]]) -> list[tuple[int, object, str | None]]:
        """Post each session's next control receive (on its own stream, after the work
        issued so far) if none is posted, and take those that arrived."""
        out = []
        for rank, name in sessions:
            s = self.sessions.get(rank)
            if s is None:
                continue
            if s.pending is None:
                s.pending = self._post_control(s)
            if not s.pending.query():
                continue
            s.pending = None
            num_tokens, flags = (int(v) for v in s.control.tolist())
            s.seq += 1
            if flags:
                out.append((rank, None, f"AFD {name} broke the protocol: a micro-batched "
                            "step (nccl serves none)"))  # fmt: skip
            elif not 0 < num_tokens <= self.ctx.max_num_tokens:
                out.append((rank, None, f"AFD {name} broke the protocol: step with "
                            f"{num_tokens} tokens is outside 1..{self.ctx.max_num_tokens}"))
            else:
                out.append((rank, Control(MSG_STEP, s.seq, num_tokens, flags), None))
        return out

    def _post_control(self, s: Session):
        """Post the session's next control receive; a handle whose ``query()`` says
        whether it arrived (a CUDA event recorded after it on the session's stream)."""
        if s.stream is None:  # a communicator of host memory (the unit tests' fake)
            return s.comm.recv(s.control, src=ATTENTION_MEMBER)
        s.stream.wait_stream(torch.cuda.current_stream(s.control.device))
        with torch.cuda.stream(s.stream):
            s.comm.recv(s.control, src=ATTENTION_MEMBER, stream=s.stream)
            done = torch.cuda.Event()
            done.record(s.stream)
        return done

    def recv(self, link: Link, out: torch.Tensor, lane: int = 0) -> None:
        self._session(link.rank, link.peer).comm.recv(out, src=ATTENTION_MEMBER)

    def send(self, link: Link, y: torch.Tensor, lane: int = 0) -> None:
        self._session(link.rank, link.peer).comm.send(y.contiguous(), dst=ATTENTION_MEMBER)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            sessions, self.sessions = list(self.sessions.values()), {}
        for s in sessions:
            _abort(s.comm)


NCCLAttentionConnector, NCCLFFNConnector = channel_connectors(
    NCCLAttentionPlane, NCCLFFNPlane, "NCCL"
)
register_connector("nccl", NCCLAttentionConnector, NCCLFFNConnector)
