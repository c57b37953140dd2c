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
* A message (one ``send``) is copied into a registered send slot and WRITten into the
  same slot of the peer's inbox (lane ``l``, slot ``seq % RING``) with its notification,
  and the sender drives the write to completion; the receiver waits for that notification
  (its own deadline), then copies the slot out. A lane never has more than 2 messages
  (hidden states and router logits) ahead of its replies, below ``RING``.
* Host copies into and out of the registered slots are plain memory copies (one thread):
  torch's intra-op threads, spinning in two processes on the same cores, turned a 128 KiB
  copy into milliseconds.
* Waits poll the agent (no progress thread: the waiting side drives its own progress),
  without sleeping for ``connector_extra_config.nixl_spin_us`` (default 2000) and then
  sleeping 0.2 ms between polls: a long spin gives the shortest hand-over where each role
  has cores of its own, a short one leaves the cores to the compute where roles share them.

Lanes: a message travels on a lane, the micro-batch it belongs to (0 outside DBO), each
lane with its own sequence numbers and inbox slots (``RING`` per lane), so two micro-batches
never wait on each other's messages. The notification is ``"<session>:<lane>:<seq>"``.

Devices: on the CPU both roles' inboxes are host memory (DRAM) and the host drives every
transfer. On CUDA the inboxes are device memory (VRAM): the FFN role's host loop copies in
and out of them on its stream; the attention role's exchanges are device work only (kernels
and a host proxy thread, ``vllm.distributed.afd.nixl_device``), so CUDA graphs capture them,
DBO runs each lane on its own stream, and a lost FFN rank is rejoined by re-running the
interrupted forward whole (``vllm.afd.rejoin.run_forward``).
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from vllm.afd.protocol import AFDHandshakeError, AFDPeerError
from vllm.distributed.afd import nixl_device
from vllm.distributed.afd.base import register_connector
from vllm.distributed.afd.channel import recv_hello, send_hello, tensor_bytes
from vllm.distributed.afd.nixl_device import RING
from vllm.distributed.afd.plane import AttentionPlane, FFNPlane, Link
from vllm.distributed.afd.tcp import channel_connectors
from vllm.logger import init_logger

logger = init_logger(__name__)

# Lanes (micro-batches per step) and slots: RING inbox slots per lane and direction.
LANES = 2
SLOTS = LANES * RING
ALIGN = 256
# A wait polls without sleeping for connector_extra_config.nixl_spin_us, then sleeps this
# long between polls (s).
SLEEP_S = 0.0002
# Transfer requests an agent keeps to post again (Agent.write): one per (peer, send slot,
# inbox slot, size) in use; the least recently used beyond this many is released.
XFER_CACHE = 256


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


def note_of(sid: str, lane: int, seq: int) -> str:
    return f"{sid}:{lane}:{seq}"


def memory_of(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id of buffers on ``device``."""
    if device.type == "cuda":
        return "VRAM", device.index if device.index is not None else torch.cuda.current_device()
    return "DRAM", 0


class Xfer:
    """A posted write (Agent.write): NIXL's request, whether the agent keeps it to post
    again (``cached``) and whether it was released."""

    __slots__ = ("handle", "cached", "released")

    def __init__(self, handle, cached: bool):
        self.handle, self.cached, self.released = handle, cached, False


class Agent:
    """One NIXL agent of this process, its notifications sorted by peer and session.

    A write from a send slot into a peer's inbox slot recurs every RING messages with the
    same size at decode: its request is made once (descriptors, the backend's preparation)
    and posted again with the new notification once the last post of it completed, so a
    post costs the host one NIXL call, not four."""

    def __init__(self, role: str, rank: int, backend: str, spin_s: float = 0.002):
        nixl_agent, nixl_agent_config = load_nixl()
        self.spin_s = spin_s
        self.name = f"afd-{role}{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        config = nixl_agent_config(enable_prog_thread=False, backends=[backend])
        self.agent = nixl_agent(self.name, config)
        self.lock = threading.Lock()
        self._notes: dict[str, set[str]] = {}  # peer agent -> notifications not yet taken
        # (peer, local slot, remote slot, bytes) -> the request posted again (write)
        self._xfers: OrderedDict[tuple, Xfer] = OrderedDict()
        self.reposts = 0  # posts of a kept request

    def metadata(self) -> str:
        with self.lock:
            return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def register(self, t: torch.Tensor):
        with self.lock:
            return self.agent.register_memory(t)

    def deregister(self, reg) -> None:
        with self.lock:
            self._drop_xfers()  # a kept request may point into this memory
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)

    def add_peer(self, metadata: str) -> str:
        with self.lock:
            name = self.agent.add_remote_agent(base64.b64decode(metadata))
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        with self.lock:
            self._drop_xfers(name)
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)
            self._notes.pop(name, None)

    def write(self, local: tuple[int, int, str], remote: tuple[int, int, str], nbytes: int,
              peer: str, note: str, who: str) -> Xfer:  # fmt: skip
        """Post a WRITE of ``nbytes`` from ``local`` to ``remote`` of ``peer`` (each an
        (address, device id, memory type) of registered memory) with notification
        ``note``: the kept request of this (peer, slots, size) when its last post
        completed, else a new one (kept when there is none, or in place of a kept one
        whose last post failed). Checked with ``done``."""
        key = (peer, local, remote, nbytes)
        with self.lock, self.peer_errors(who):
            x = self._xfers.get(key)
            last = None if x is None else self.agent.check_xfer_state(x.handle)
            if last == "ERR":  # a request that failed is not posted again: made anew
                self._uncache(self._xfers.pop(key), last)
            if last == "DONE":
                self._xfers.move_to_end(key)
                state = self.agent.transfer(x.handle, note.encode())
                self.reposts += 1
            else:
                src = self.agent.get_xfer_descs([(local[0], nbytes, local[1])], local[2])
                dst = self.agent.get_xfer_descs([(remote[0], nbytes, remote[1])], remote[2])
                handle = self.agent.initialize_xfer("WRITE", src, dst, peer, note.encode())
                x = Xfer(handle, cached=key not in self._xfers)
                if x.cached:
                    self._xfers[key] = x
                    if len(self._xfers) > XFER_CACHE:
                        self._uncache(self._xfers.popitem(last=False)[1])
                state = self.agent.transfer(handle)
        if state == "ERR":
            raise AFDPeerError(f"lost AFD peer {who}: posting a nixl write failed")
        return x

    def done(self, x: Xfer, who: str) -> bool:
        """The write ``x`` completed (a request the agent does not keep is released)."""
        with self.lock, self.peer_errors(who):
            if x.released:
                return True
            state = self.agent.check_xfer_state(x.handle)
            if state == "DONE" and not x.cached:
                self._release(x)
        if state == "ERR":
            raise AFDPeerError(f"lost AFD peer {who}: a nixl write failed")
        return state == "DONE"

    def kept(self) -> int:
        """How many requests the agent keeps to post again."""
        with self.lock:
            return len(self._xfers)

    def _release(self, x: Xfer) -> None:
        x.released = True
        with contextlib.suppress(Exception):  # NIXL keeps one it cannot free (its leak list)
            self.agent.release_xfer_handle(x.handle)

    def _uncache(self, x: Xfer, state: str | None = None) -> None:
        """Under the lock: stop keeping ``x``; released now unless a post of it is in
        flight (then ``done`` releases it once it completed). ``state``: its state when
        the caller has just read it (else read here)."""
        x.cached = False
        if state is None:
            with contextlib.suppress(Exception):
                state = self.agent.check_xfer_state(x.handle)
        if state != "PROC":
            self._release(x)

    def _drop_xfers(self, peer: str | None = None) -> None:
        """Under the lock: stop keeping the requests to ``peer`` (None: all)."""
        for key in [k for k in self._xfers if peer is None or k[0] == peer]:
            self._uncache(self._xfers.pop(key))

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

    def has(self, peer: str, note: str) -> bool:
        """The notification ``note`` of ``peer`` arrived (polled) and was not taken."""
        with self.lock:
            return note in self._notes.get(peer, ())

    def take(self, peer: str, note: str) -> bool:
        with self.lock:
            got = self._notes.get(peer)
            if got is not None and note in got:
                got.discard(note)
                return True
            return False

    def take_notes(self, peer: str, sid: str) -> list[tuple[int, int]]:
        """Every notification of session ``sid`` from ``peer`` not yet taken, as
        (lane, seq), taken."""
        prefix = sid + ":"
        out = []
        with self.lock:
            got = self._notes.get(peer, set())
            for note in [n for n in got if n.startswith(prefix)]:
                got.discard(note)
                lane, _, seq = note[len(prefix):].partition(":")
                if lane.isdigit() and seq.isdigit():
                    out.append((int(lane), int(seq)))
        return out

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
        with self.lock:
            self._drop_xfers()
        agent, self.agent = self.agent, None
        del agent  # the agent's destructor releases its backend


class Mailbox:
    """One session's registered memory on one side (host or device memory): an inbox of
    SLOTS slots that the peer writes into, and the send slots this side writes from."""

    def __init__(self, agent: Agent, slot: int, device: torch.device):
        self.slot = slot
        self.device = device
        self.mem, self.dev_id = memory_of(device)
        self.inbox = torch.zeros(SLOTS * slot, dtype=torch.uint8, device=device)
        self.outbox = torch.zeros(SLOTS * slot, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed before the peer can write
        self.regs = [agent.register(self.inbox), agent.register(self.outbox)]

    def address(self) -> int:
        return self.inbox.data_ptr()

    def out_slot(self, index: int) -> tuple[int, int, str]:
        return self.outbox.data_ptr() + index * self.slot, self.dev_id, self.mem

    def release(self, agent: Agent) -> None:
        for reg in self.regs:
            agent.deregister(reg)
        self.regs = []


class Session:
    """What one side knows of a session with its peer."""

    def __init__(self, sid: str, peer_agent: str, peer_inbox: tuple[int, int, str],
                 box: Mailbox, who: str):  # fmt: skip
        self.sid = sid
        self.peer_agent = peer_agent
        self.peer_inbox = peer_inbox  # (address, device id, memory type)
        self.box = box
        self.who = who
        self.sent = [0] * LANES
        self.claimed = [0] * LANES  # receives handed out per lane (their sequence numbers)
        self.writing: dict[int, object] = {}  # posted writes not yet complete, by send slot

    def peer_slot(self, index: int) -> tuple[int, int, str]:
        addr, dev, mem = self.peer_inbox
        return addr + index * self.box.slot, dev, mem


def slot_index(lane: int, seq: int) -> int:
    if not 0 <= lane < LANES:
        raise AFDPeerError(f"AFD nixl: lane {lane} outside 0..{LANES - 1}")
    return lane * RING + seq % RING


def _view(box_bytes: torch.Tensor, slot: int, index: int, like: torch.Tensor) -> torch.Tensor:
    n = like.numel() * like.element_size()
    if n > slot:
        raise AFDPeerError(
            f"AFD nixl: a message of {n} bytes exceeds the inbox slot ({slot} bytes)"
        )
    start = index * slot
    return box_bytes[start:start + n]


def write_message(agent: Agent, s: Session, lane: int, x: torch.Tensor, timeout: float) -> None:
    """Write one message and drive the write to completion (the sender's agent makes its
    own progress: a posted write left alone may not leave this host)."""
    agent.wait_done(post_message(agent, s, lane, x), time.monotonic() + timeout, s.who)


def post_message(agent: Agent, s: Session, lane: int, x: torch.Tensor):
    """Copy one message into its send slot and post its write; the handle, for
    ``Agent.done`` (the caller drives it to completion)."""
    seq = s.sent[lane]
    index = slot_index(lane, seq)
    box = s.box
    if box.device.type == "cuda":
        out = _view(box.outbox, box.slot, index, x)
        if out.numel():
            out.view(x.dtype).view(x.shape).copy_(x)
        torch.cuda.current_stream(box.device).synchronize()  # the slot holds it
    else:
        host = x.contiguous() if x.device.type == "cpu" else x.contiguous().cpu()
        out = _view(box.outbox, box.slot, index, host)
        if out.numel():
            tensor_bytes(out)[:] = tensor_bytes(host)
    handle = agent.write(box.out_slot(index), s.peer_slot(index), max(1, out.numel()),
                         s.peer_agent, note_of(s.sid, lane, seq), s.who)  # fmt: skip
    s.sent[lane] += 1
    return handle


def claim(s: Session, lane: int) -> int:
    """The sequence number of the next message to receive on ``lane`` (receives complete
    in the order they were claimed, whatever order they are waited for in)."""
    seq = s.claimed[lane]
    s.claimed[lane] += 1
    return seq


def read_message(agent: Agent, s: Session, lane: int, seq: int, out: torch.Tensor,
          deadline: float) -> None:  # fmt: skip
    agent.wait_for(s.peer_agent, note_of(s.sid, lane, seq), deadline, s.who)
    copy_message(s, lane, seq, out)


def copy_message(s: Session, lane: int, seq: int, out: torch.Tensor) -> None:
    """Copy message ``seq`` of ``lane`` (its notification taken) out of the inbox."""
    src = _view(s.box.inbox, s.box.slot, slot_index(lane, seq), out)
    if not out.numel():
        return
    if out.device.type == "cpu" and src.device.type == "cpu" and out.is_contiguous():
        tensor_bytes(out)[:] = tensor_bytes(src)
    else:
        out.copy_(src.view(out.dtype).view(out.shape))


def _hello(agent: Agent, box: Mailbox, **extra) -> dict:
    return {"nixl_agent": agent.name, "nixl_meta": agent.metadata(),
            "nixl_inbox": box.address(), "nixl_slot": box.slot, "nixl_slots": SLOTS,
            "nixl_mem": box.mem, "nixl_dev": box.dev_id, **extra}  # fmt: skip


def _peer_of(hello: dict, slot: int, who: str) -> tuple[str, str, tuple[int, int, str]]:
    if hello.get("error"):
        raise AFDHandshakeError(f"AFD {who} refused the nixl data plane: {hello['error']}")
    meta, name, inbox = hello.get("nixl_meta"), hello.get("nixl_agent"), hello.get("nixl_inbox")
    mem, dev = hello.get("nixl_mem", "DRAM"), hello.get("nixl_dev", 0)
    if not (isinstance(meta, str) and isinstance(name, str) and isinstance(inbox, int)
            and mem in ("DRAM", "VRAM") and isinstance(dev, int)):  # fmt: skip
        raise AFDHandshakeError(f"AFD {who} sent no nixl agent (is it a nixl FFN server?)")
    if hello.get("nixl_slot") != slot or hello.get("nixl_slots", SLOTS) != SLOTS:
        raise AFDHandshakeError(
            f"AFD {who}: nixl inbox slots differ ({hello.get('nixl_slots')} x "
            f"{hello.get('nixl_slot')} vs {SLOTS} x {slot} bytes): max_num_batched_tokens, "
            "the model or the build differ"
        )
    return name, meta, (inbox, dev, mem)


# ------------------------------------------------------------------ attention side
class NixlAttentionPlane(AttentionPlane):
    """On the CPU the host sends and waits; on CUDA the exchanges are device work and a
    proxy thread posts them (``nixl_device``): capturable, re-run whole after a loss."""

    graph_capable = True
    dbo_capable = True

    def __init__(self, ctx):
        super().__init__(ctx)
        load_nixl()  # fail at start, naming the package
        self.backend, self.spin_s = plane_settings(ctx)
        self.slot = slot_bytes(ctx)
        self.on_device = ctx.device.type == "cuda"
        # A graph cannot re-run half a step: on the device a lost FFN rank is rejoined
        # by re-running the forward whole (vllm.afd.rejoin.run_forward).
        self.reruns_forward = self.on_device
        self.carries_control = self.on_device
        self.agent: Agent | None = None
        self.box: Mailbox | None = None
        self.session: Session | None = None
        self.lanes: nixl_device.DeviceLanes | None = None
        self.proxy: nixl_device.Proxy | None = None
        self._streams: list = []
        self._sessions = 0
        timeout = float(ctx.config.timeout_s)
        self.timeout_ns = int(timeout * 1e9)

    def _start(self) -> None:
        if self.agent is not None:
            return
        self.agent = Agent("attention", self.ctx.rank, self.backend, self.spin_s)
        self.box = Mailbox(self.agent, self.slot, self.ctx.device)
        if self.on_device:
            dev = self.ctx.device
            self.lanes = nixl_device.DeviceLanes(LANES, dev)
            # DBO: each lane waits for its replies on a stream of its own (recv_start), so
            # that one micro-batch's wait never holds the other's work
            self._streams = [torch.cuda.Stream(device=dev) for _ in range(LANES)]
            self._control_stream = torch.cuda.Stream(device=dev)
            self.proxy = nixl_device.Proxy(self.agent, self.lanes.records, self.lanes.controls,
                                           self.lanes.flags, LANES, self.spin_s,
                                           err=self.lanes.err,
                                           waited=self.lanes.waited)  # fmt: skip

    def connect(self, link: Link, deadline: float) -> object:
        self._start()
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
        if self.proxy is not None:
            self.lanes.reset()  # between forwards: the new session starts at message 0
            self.proxy.serve(self._target(offer, link), link.peer)
            self._sessions += 1
            if self._sessions == 1:
                logger.info("AFD: nixl device path to %s (VRAM inboxes, %d lanes x %d "
                            "slots of %d bytes; a host proxy posts the exchanges)",
                            link.peer, LANES, RING, self.slot)  # fmt: skip
            else:
                logger.info("AFD: nixl device path to %s: a new session (rings and counters "
                            "from message 0)", link.peer)  # fmt: skip

    def _target(self, s: Session, link: Link) -> nixl_device.Target:
        agent = self.agent

        def write(lane: int, seq: int, nbytes: int, note: str):
            index = slot_index(lane, seq)
            return agent.write(s.box.out_slot(index), s.peer_slot(index), max(1, nbytes),
                               s.peer_agent, note, s.who)  # fmt: skip

        def lost(why: str) -> None:
            if link.lost is not None:
                link.lost(why)

        return nixl_device.Target(s.sid, s.peer_agent, write, link.control, lost)

    def discard(self, offer: object) -> None:
        if offer is not None and (self.session is None
                                  or self.session.peer_agent != offer.peer_agent):
            self.agent.remove_peer(offer.peer_agent)

    def detach(self) -> None:
        session, self.session = self.session, None
        if self.proxy is not None:
            self.proxy.release(None)
        if session is not None:
            self.agent.remove_peer(session.peer_agent)
        super().detach()

    def lost(self, why: str) -> None:
        """The channel found the FFN rank lost: device waits end now (the pass's output is
        discarded by the forward's check)."""
        if self.proxy is not None:
            self.proxy.release(why)

    def _live(self) -> tuple[Session, Link]:
        if self.session is None or self.link is None:
            raise AFDPeerError("AFD attention rank has no FFN session (nixl)")
        return self.session, self.link

    # -- the step (device: enqueued work only) -----------------------------------------
    def begin_step(self, num_tokens: int, flags: int) -> None:
        """The step's control message, as device work (``carries_control``). The control
        records of all lanes go through one stream, in the order the micro-batches open
        (micro-batch 0 first: the FFN rank takes a step from it), joined back into the
        caller's stream (a capture records the fork and the join)."""
        current = torch.cuda.current_stream(self.ctx.device)
        self._control_stream.wait_stream(current)
        with torch.cuda.stream(self._control_stream):
            self.lanes.control(num_tokens, flags)
        current.wait_stream(self._control_stream)

    def send(self, x: torch.Tensor, lane: int = 0) -> None:
        """On the device: a copy and a record on the current stream (nothing waits)."""
        s, link = self._live()
        if not self.on_device:
            write_message(self.agent, s, lane, x, link.timeout)
            return
        if x.numel() * x.element_size() > self.slot:
            raise AFDPeerError(f"AFD nixl: a message of {x.numel() * x.element_size()} bytes "
                               f"exceeds the inbox slot ({self.slot} bytes)")  # fmt: skip
        self.lanes.send(lane, x.contiguous(), self.box.outbox, self.slot)

    def _device_recv(self, lane: int, out: torch.Tensor) -> None:
        self.lanes.recv(lane, out, self.box.inbox, self.slot, self.timeout_ns)

    def recv(self, out: torch.Tensor, lane: int = 0) -> torch.Tensor:
        s, link = self._live()
        if not self.on_device:
            read_message(self.agent, s, lane, claim(s, lane), out, time.monotonic() + link.timeout)
            return out
        self._device_recv(lane, out)  # the wait and the copy, on the current stream
        self._settle_eager(torch.cuda.current_stream(self.ctx.device))
        return out

    def _settle_eager(self, stream) -> None:
        """Outside a capture, wait for the exchange here, with the GIL released: the proxy
        thread that serves it needs the GIL, and the caller may next make a blocking CUDA
        call that holds it (a cudaFree of the allocator's cache, at start-up), which would
        wait on a device wait that waits on the proxy. Eager steps pay a synchronisation a
        layer; replayed graphs are waited for once, after the forward (run_forward)."""
        if not torch.cuda.is_current_stream_capturing():
            stream.synchronize()

    def recv_start(self, out: torch.Tensor, lane: int = 0) -> Callable[[], torch.Tensor]:
        """DBO: the FFN rank writes the reply into the inbox whenever it is ready (nothing
        to drain, unlike a socket); ``wait()`` takes the reply this call claimed (on the
        device: makes the current stream wait for the lane's receive)."""
        s, link = self._live()
        if self.on_device:
            stream = self._streams[lane]
            stream.wait_stream(torch.cuda.current_stream(self.ctx.device))
            with torch.cuda.stream(stream):
                self._device_recv(lane, out)
                done = torch.cuda.Event()
                done.record(stream)

            def wait_device() -> torch.Tensor:
                torch.cuda.current_stream(self.ctx.device).wait_event(done)
                self._settle_eager(stream)
                return out

            return wait_device
        seq, timeout = claim(s, lane), link.timeout

        def wait() -> torch.Tensor:
            read_message(self.agent, s, lane, seq, out, time.monotonic() + timeout)
            return out

        return wait

    def step_lost(self) -> str | None:
        """After a forward (its device work waited for): why its exchanges failed (a wait
        that timed out, a write the proxy could not post), None when they did not."""
        if not self.on_device:
            return None
        torch.cuda.current_stream(self.ctx.device).synchronize()
        seq = self.lanes.error_word()
        if seq:
            return (f"AFD peer {self.link.peer if self.link else 'FFN rank'} did not answer "
                    f"within the timeout (timeout_s={self.ctx.config.timeout_s:g}, layer "
                    f"message {seq}, nixl)")  # fmt: skip
        return self.proxy.error

    def close(self) -> None:
        self.detach()
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.box is not None:
            self.box.release(self.agent)
            self.box = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None


# ------------------------------------------------------------------ FFN side
class NixlFFNPlane(FFNPlane):
    """The FFN rank's host loop: it waits for a message's notification, copies the slot
    (host or device memory) out, and writes the reply from its own slot. Its messages are
    posted and checked (``polled``): the channel's pump polls the agent once a round and
    checks the notifications of every session's posted receives and the states of their
    posted writes, so no session waits on another's."""

    dbo_capable = True
    polled = True

    def __init__(self, ctx):
        super().__init__(ctx)
        load_nixl()
        backend, spin_s = plane_settings(ctx)
        self.slot = slot_bytes(ctx)
        self.agent = Agent("ffn", ctx.rank, backend, spin_s)
        self.sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        logger.info("AFD: FFN rank %d nixl agent %s (backend %s, %s, %d-byte slots)",
                    ctx.rank, self.agent.name, backend, memory_of(ctx.device)[0],
                    self.slot)  # fmt: skip

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
        box = Mailbox(self.agent, self.slot, self.ctx.device)
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

    def recv(self, link: Link, out: torch.Tensor, lane: int = 0) -> None:
        s = self._session(link)
        read_message(self.agent, s, lane, claim(s, lane), out, time.monotonic() + link.timeout)

    def send(self, link: Link, y: torch.Tensor, lane: int = 0) -> None:
        write_message(self.agent, self._session(link), lane, y, link.timeout)

    # -- posted I/O (polled) ------------------------------------------------------
    def recv_posted(self, link: Link, out: torch.Tensor, lane: int = 0) -> Callable[[], bool]:
        s = self._session(link)
        seq = claim(s, lane)
        slot_index(lane, seq)  # a bad lane is refused now
        note = note_of(s.sid, lane, seq)
        agent = self.agent

        def check() -> bool:
            if not agent.take(s.peer_agent, note):
                return False
            copy_message(s, lane, seq, out)
            return True

        return check

    def send_posted(self, link: Link, y: torch.Tensor, lane: int = 0) -> Callable[[], bool]:
        s = self._session(link)
        index = slot_index(lane, s.sent[lane])
        old = s.writing.pop(index, None)
        if old is not None:  # the write of this slot RING messages ago (not in practice:
            # the peer answered those since): its slot is not rewritten under it
            self.agent.wait_done(old, time.monotonic() + link.timeout, s.who)
        handle = post_message(self.agent, s, lane, y)
        s.writing[index] = handle
        agent = self.agent

        def done() -> bool:
            if s.writing.get(index) is not handle:
                return True  # waited for above
            if not agent.done(handle, s.who):
                return False
            del s.writing[index]
            return True

        return done

    def progress(self) -> None:
        self.agent.poll(f"FFN rank {self.ctx.rank}'s nixl agent")

    def idle_wait(self, waited: float) -> float:
        """Poll without sleeping for nixl_spin_us after the last message moved, then
        every SLEEP_S (as a blocking wait does)."""
        return 0.0 if waited < self.agent.spin_s else SLEEP_S

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
