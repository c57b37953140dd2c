# SPDX-License-Identifier: Apache-2.0
"""CUDA IPC connector for AFD on the GPUs of one host (``cuda_ipc``): the control
channel (``vllm.distributed.afd.tcp``) composed with the cuda_ipc data plane
(:class:`IPCAttentionPlane`, :class:`IPCFFNPlane`), a plane of device sessions
(``AttentionPlane.device_session``, ``FFNPlane.polls_steps``).

The layer exchange is device work only, so the attention role can capture it
in CUDA graphs and the FFN role can replay its own graphs:

* each side allocates an *inbox* in its own GPU memory (data buffer plus a
  row of int64 flags) and hands the other side a CUDA IPC handle to it over
  the channel's connection, right after the channel's handshake (the plane's
  ``connect`` and ``attach``);
* a message is a copy into the peer's inbox followed by a one-program Triton
  kernel (``vllm.distributed.afd.ipc_kernels``) that bumps a device-side counter
  and release-stores it into the peer's flag; the receiver's kernel spins on its
  own flag (acquire) until it reaches its own counter + 1, then a copy takes the
  message out. Counters live on the device, so a replayed graph advances them
  like an eager step does (one hand-over costs about 5 us on an H200 under MPS,
  benchmarks/handover.py);
* the step-control message (token count, flags) is written the same way, into
  the attention rank's control buffer on the FFN rank; the FFN host polls the
  control buffers of its ranks with small copies on a side stream (the FFN
  rank has nothing else to do meanwhile);
* isolation: every buffer a side exports sits alone in a cudaMalloc segment
  (CUDA IPC maps the peer the whole segment), and the FFN rank exports to each
  attention rank only that rank's inbox and control buffer (its control row,
  its data flags, the error word of the waits for its data): a rank can
  neither reach another rank's steps nor end their sessions. A peer's buffer
  description is checked field by field against the exact size this side
  needs before anything is mapped, and the mapped segment's size after; the
  peer's reference-counter and event fields are never used;
* DBO: every inbox, flag and counter exists once per micro-batch slot (up to
  its spec record's ``max_ubatches``). Micro-batch 0's control message announces the token
  counts of all micro-batches of the step (the FFN rank can then replay one
  graph for the whole step), and each micro-batch's exchange runs on its own
  side stream of the attention rank, joined back to the compute stream only
  when its thread resumes - so the other micro-batch's attention kernels run
  while this one waits for the FFN rank.

No host synchronisation per layer on the attention side and no per-step host
round trip: the attention host only launches work.

Failure stays explicit and bounded: every device wait gives up after
``timeout_s`` (``globaltimer``) and sets an error word; the channel's watchdog
thread on the attention side reads that word (the plane's ``probe``) and watches
the connection (EOF of a dead FFN rank is immediate) and, on a failure, records it for the engine-death message
and ends the process (its GPU stream may be stuck behind a wait, and the
step's output must not reach a client). The connection keeps carrying
heartbeats, goodbye and profiler requests.

Rejoin (opt-in, ``connector_extra_config.ipc_rejoin``; docs/connectors.md says
what one H200 proved): the attention side's graphs then reach the FFN rank's
buffers only through a small device-side pointer table of the attention side's
(``ipc_kernels.*_via``), which a re-handshake with a restarted FFN rank
rewrites; everything else they touch is the attention side's own and never
moves. A loss is held instead of ending the process (own waits released), and
``vllm.afd.rejoin.run_forward`` re-runs the whole forward after the rejoin.
Without the key (the default) nothing of this runs.

Both processes must see the GPU of the other (one host; on several GPUs give
both the same devices in ``CUDA_VISIBLE_DEVICES``, in an order that makes
each process's device 0 its own GPU).
"""

from __future__ import annotations

import time

import torch

from vllm.afd.connector_spec import SPECS
from vllm.afd.protocol import (
    HELLO_PREAMBLE,
    MSG_STEP,
    AFDPeerError,
    AFDProtocolError,
    Control,
    pack_hello,
    parse_hello,
    printable,
    shown,
    ubatch_flags,
    ubatch_of,
    unpack_hello_preamble,
)
from vllm.afd.roles import unless_capturing
from vllm.distributed.afd import ipc_kernels as kernels
from vllm.distributed.afd.base import ConnectorContext, register_connector
from vllm.distributed.afd.channel import recv_bytes as _recv_bytes
from vllm.distributed.afd.channel import send_all as _send_all
from vllm.distributed.afd.channel import socket_lost  # noqa: F401 - the watchdog's probe
from vllm.distributed.afd.plane import AttentionPlane, FFNPlane, Link
from vllm.distributed.afd.tcp import channel_connectors
from vllm.logger import init_logger

logger = init_logger(__name__)

ALIGN = 256
ROW = 8  # int64 words per flag row (64 bytes: every pointer the kernels get is aligned alike)
# Control buffer of one attention rank on its FFN rank (one per rank, exported
# to that rank only): row 0 the control row - [0] control flag, [1] payload
# seq, [2] num_tokens, [3] flags, [4, 5] data flags of micro-batch slots 0 and
# 1, [6] num_tokens of micro-batch 1 (DBO steps) -; row 1 [0] the error word of
# the FFN rank's device waits for this rank's data.
C_FLAG, C_SEQ, C_TOKENS, C_FLAGS, C_DATA, C_UB1_TOKENS = 0, 1, 2, 3, 4, 6
CTRL_ROWS, ERR_ROW = 2, 1
CTRL_BYTES = CTRL_ROWS * ROW * 8
# The attention rank's flag row (exported to its FFN rank): [s] the data flag
# of micro-batch slot s, written by the FFN rank.
FLAGS_BYTES = ROW * 8
SLOTS = SPECS["cuda_ipc"].max_ubatches
assert C_DATA + SLOTS <= C_UB1_TOKENS and SLOTS == 2
POISON = 1 << 62


def ipc_rejoin(config) -> bool:
    """``connector_extra_config.ipc_rejoin`` (default False): the attention role
    rejoins a restarted FFN rank on cuda_ipc (docs/connectors.md; proven on one H200,
    tests/gpu/test_gpu_ipc_restart.py)."""
    value = config.connector_extra_config.get("ipc_rejoin", False)
    if not isinstance(value, bool):
        raise ValueError(
            f"AFD: connector_extra_config.ipc_rejoin must be true or false; got {value!r}"
        )
    return value


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ------------------------------------------------------- IPC of raw buffers
# torch's shareable handle of a cudaMalloc segment: a version byte, b"c", then
# the 64-byte cudaIpcMemHandle_t. CUDA IPC maps the importer the whole segment.
IPC_HANDLE_BYTES = 66
_HANDLE_CUDA_MALLOC = ord("c")
_HANDLE_EXPANDABLE = ord("e")
# torch's CUDA IPC names a shared-memory reference counter that the importing
# process decrements when it drops the mapping. A peer's counter is never used
# (it would let the peer pick an int64 in any shared-memory file of this host's
# user for this process to decrement): the importer passes this name instead,
# which shm_open refuses (EINVAL, a '/' inside the name), so torch's deleter
# finds no counter and skips the decrement (its path for a producer that has
# already exited). The exporter's buffers live as long as its process anyway.
NO_REF_COUNTER = b"/afd-cuda-ipc/no-ref-counter"
# Buffers exported to a peer: each in a memory pool of its own (see
# exported_zeros), kept for the life of the process.
_EXPORT_POOLS: list = []


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: vLLM's device config says "cuda" without one (the
    current device), which torch's memory-pool context refuses."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def exported_zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed 1-D uint8 CUDA buffer alone in a cudaMalloc segment: CUDA IPC
    maps a peer the whole segment of a buffer, so nothing else of this process
    (another peer's buffer, model memory) may share it. A private memory pool
    per buffer gives it a fresh segment, starting at the buffer."""
    device = indexed(device)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device=device):
        t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    _EXPORT_POOLS.append(pool)
    return t


def export_buffer(t: torch.Tensor) -> dict:
    """A JSON-able description of a buffer of ``exported_zeros`` for another
    process of this host (torch's own CUDA IPC, without pickling). Only the
    mapping itself travels: no reference counter, no event (the exporter
    synchronises its device before it sends the description)."""
    from torch.multiprocessing.reductions import reduce_tensor

    assert t.dtype == torch.uint8 and t.dim() == 1 and t.is_cuda
    _, args = reduce_tensor(t)
    _, size, _, offset, _, _, device, handle, storage_bytes, storage_offset = args[:10]
    return {
        "numel": int(size[0]),
        "offset": int(offset),
        "device": int(device),
        "handle": bytes(handle).hex(),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
    }


def _int_field(d: dict, key: str, what: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise AFDProtocolError(
            f"bad CUDA IPC description of the peer's {what}: {key!r} is {shown(v)}, "
            "expected a non-negative integer"
        )
    return v


def check_buffer_desc(d: dict, nbytes: int, what: str, num_devices: int) -> tuple[int, bytes]:
    """(device, handle) of a peer's description of its ``what`` buffer, which
    must be exactly the ``nbytes`` this side needs, a whole segment of the
    peer's (``exported_zeros``), on one of the ``num_devices`` devices this
    process sees, with a handle of torch's cudaMalloc format. Every field is
    checked before anything is mapped; AFDProtocolError names the first one
    that is off. Fields beyond these (a reference counter, an event) are
    ignored."""
    if not isinstance(d, dict):
        raise AFDProtocolError(f"bad CUDA IPC description of the peer's {what}: not an object")
    fields = {k: _int_field(d, k, what)
              for k in ("numel", "offset", "device", "storage_bytes", "storage_offset")}  # fmt: skip
    expected = {"numel": nbytes, "offset": 0, "storage_bytes": nbytes, "storage_offset": 0}
    for key, want in expected.items():
        if fields[key] != want:
            raise AFDProtocolError(
                f"bad CUDA IPC description of the peer's {what}: {key!r} is {fields[key]}, "
                f"this side needs {want} (a {nbytes}-byte buffer at the start of its own "
                "segment; is the peer a different build of the connector?)"
            )
    if fields["device"] >= num_devices:
        raise AFDProtocolError(
            f"bad CUDA IPC description of the peer's {what}: 'device' is {fields['device']}, "
            f"this process sees {num_devices} CUDA device(s)"
        )
    handle = d.get("handle")
    try:
        raw = bytes.fromhex(handle) if isinstance(handle, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != IPC_HANDLE_BYTES or raw[1] != _HANDLE_CUDA_MALLOC:
        hint = ""
        if raw is not None and len(raw) > 1 and raw[1] == _HANDLE_EXPANDABLE:
            hint = (
                " (an expandable segment: set PYTORCH_CUDA_ALLOC_CONF without "
                "expandable_segments:True on both servers)"
            )
        raise AFDProtocolError(
            f"bad CUDA IPC description of the peer's {what}: 'handle' is not a "
            f"{IPC_HANDLE_BYTES}-byte CUDA IPC handle of a cudaMalloc segment{hint}"
        )
    return fields["device"], raw


def import_buffer(d: dict, nbytes: int, what: str) -> torch.Tensor:
    """Map the peer's ``what`` buffer of ``nbytes`` bytes (a description of
    ``export_buffer``), after ``check_buffer_desc``; then refuse it unless the
    peer's mapped segment really holds ``nbytes`` bytes from its start."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device, handle = check_buffer_desc(d, nbytes, what, torch.cuda.device_count())
    t = rebuild_cuda_tensor(
        torch.Tensor, torch.Size([nbytes]), (1,), 0, torch.storage.TypedStorage,
        torch.uint8, device, handle, nbytes, 0, False,
        NO_REF_COUNTER, 0, b"", False,
    )  # fmt: skip
    base, size = mapped_range(t.data_ptr())
    if base != t.data_ptr() or size < nbytes:
        raise AFDProtocolError(
            f"the peer's {what} maps {size} bytes at offset {t.data_ptr() - base} of its "
            f"segment, this side needs {nbytes} from its start"
        )
    return t


def mapped_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation (here: the mapping of a peer's
    segment) that holds ``ptr``: cuMemGetAddressRange of the CUDA driver."""
    import ctypes

    fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise AFDProtocolError(f"cannot read the range of a mapped CUDA IPC buffer (CUresult {rc})")
    return base.value, size.value


def _exchange_desc(sock, mine: dict, deadline: float, peer: str, timeout: float) -> dict:
    """Send our buffer descriptions and read the peer's (hello framing)."""
    _send_all(sock, pack_hello(mine), timeout, peer)
    n = unpack_hello_preamble(_recv_bytes(sock, HELLO_PREAMBLE.size, deadline, peer))
    return parse_hello(_recv_bytes(sock, n, deadline, peer))


def message_bytes(ctx: ConnectorContext) -> int:
    """Inbox size of one micro-batch slot: one layer's messages at the largest
    step (hidden states, plus float32 router logits when the gate runs on the
    attention role)."""
    hidden = int(ctx.fingerprint["hidden_size"])
    dtype = getattr(torch, str(ctx.fingerprint["dtype"]))
    per_token = hidden * torch.empty((), dtype=dtype).element_size()
    if ctx.config.compute_gate_on_attention:
        per_token += 4 * int(ctx.num_router_logits or 0)
    return _align(ctx.max_num_tokens * per_token) + 2 * ALIGN


def _view(
    buf: torch.Tensor, offset: int, like: torch.Tensor, slot: int = 0, slot_bytes: int = 0
) -> torch.Tensor:
    """``like``-shaped view of ``buf`` at ``offset`` inside micro-batch slot
    ``slot`` (of ``slot_bytes``; 0: the whole buffer)."""
    n = like.numel() * like.element_size()
    size = slot_bytes or buf.numel()
    if offset + n > size:
        raise AFDProtocolError(
            f"AFD cuda_ipc: message of {n} bytes at offset {offset} exceeds the inbox "
            f"({size} bytes)"
        )
    start = slot * size + offset
    return buf[start : start + n].view(like.dtype).view(like.shape)


def _timeout_ns(ctx: ConnectorContext) -> int:
    return int(float(ctx.config.timeout_s) * 1e9)


# ----------------------------------------------------------- attention side
def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID ("" where it cannot be read): the same physical device has the
    same UUID in every process, whatever CUDA_VISIBLE_DEVICES numbers it."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (RuntimeError, AssertionError, AttributeError):
        return ""


def send_message(src: torch.Tensor, dst: torch.Tensor, ctr: torch.Tensor, flag: torch.Tensor) -> None:
    """Copy ``src`` into the peer's inbox view ``dst`` and signal the peer's ``flag``."""
    dst.copy_(src)
    kernels.signal(ctr, flag)


def recv_message(
    src: torch.Tensor, out: torch.Tensor, ctr: torch.Tensor, flag: torch.Tensor,
    err: torch.Tensor, timeout_ns: int,
) -> None:  # fmt: skip
    """Wait for the peer's signal on ``flag`` (bounded; ``err`` on a timeout), then
    copy this side's inbox view ``src`` into ``out``."""
    kernels.wait(ctr, flag, err, timeout_ns)
    out.copy_(src)


class IPCAttentionPlane(AttentionPlane):
    """The attention rank's side: its own flag row and outbox (exported to the FFN rank),
    the FFN rank's control buffer and inbox mapped here, device counters; every step is
    device work on the current stream (``device_session``: the channel's watchdog probes
    the error word, ``probe``)."""

    graph_capable = True
    dbo_capable = True
    carries_control = True
    device_session = True
    # run_forward checks the forwards whose losses are held only (ipc_rejoin).
    checks_every_forward = False
    # By default a new FFN rank maps new buffers at new addresses that this rank's
    # captured graphs do not know: a lost FFN rank ends the engine
    # (docs/connectors.md); with ipc_rejoin the forward is re-run whole after a rejoin.

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        cfg = ctx.config
        self.timeout = float(cfg.timeout_s)
        self.timeout_ns = _timeout_ns(ctx)
        home = cfg.ffn_rank_of(ctx.rank)
        self.peer = f"FFN rank {home} at {cfg.ffn_address_text(home)}"  # (the link's, once up)
        self.slot_bytes = 0  # set with the buffers (message_bytes)
        self.peer_gpu: str | None = None  # the FFN rank's GPU UUID (its reply)
        self._send_off = [0] * SLOTS
        # Rejoin (connector_extra_config.ipc_rejoin): the graphs reach the FFN
        # rank's buffers through self.table only; a loss is held (not fatal) once
        # the model forward runs under vllm.afd.rejoin.run_forward.
        self.reruns_forward = ipc_rejoin(cfg)
        self.rejoins = self.reruns_forward
        self.table: torch.Tensor | None = None
        self._mine: dict | None = None
        self._ready = False  # the device channel is set up (first connect)

    def connect(self, link: Link, deadline: float) -> object:
        """The first connection sets the device channel up (``_setup_device``); a
        re-handshake with a restarted FFN rank (ipc_rejoin) maps it again (``_remap``)."""
        self.peer = link.peer
        if not self._ready:
            self._setup_device(link.sock)
        else:
            self._remap(link.sock, deadline)
        return None

    def _setup_device(self, sock=None) -> None:
        dev = self.ctx.device
        if dev.type != "cuda":
            raise RuntimeError("AFD cuda_ipc connector needs a CUDA device")
        self._make_own(dev)
        torch.cuda.synchronize(dev)  # zeroed before the FFN rank can write them
        self._map_peer(sock, time.monotonic() + self.timeout)
        self._host_err = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._side = torch.cuda.Stream(device=dev)
        # DBO: one stream per micro-batch for its exchange (see the module docstring).
        self._ub_streams = [torch.cuda.Stream(device=dev) for _ in range(SLOTS)]
        if self.reruns_forward:
            # The FFN rank's addresses, read by the graphs' kernels (ipc_kernels.*_via).
            self.table = torch.zeros(ROW, dtype=torch.int64, device=dev)
            self._point_table()
        kernels.require()
        self._ready = True
        logger.info(
            "AFD: cuda_ipc device channel to %s mapped (inbox %d bytes, %d micro-batch slots)",
            self.peer,
            self.inbox.numel(),
            SLOTS,
        )

    def _make_own(self, dev: torch.device) -> None:
        """This rank's own buffers and their descriptions (``self._mine``)."""
        self.slot_bytes = message_bytes(self.ctx)
        # Exported to the FFN rank, which writes them: the data flags of the
        # micro-batch slots and the outbox (each alone in its segment).
        flags = exported_zeros(FLAGS_BYTES, dev)
        self.outbox = exported_zeros(SLOTS * self.slot_bytes, dev)
        # This rank's own: row 0 [0] the error word; row 1 the control counter;
        # rows 2 + 2s, 3 + 2s: counters of data sent / received in slot s.
        self.state = torch.zeros((2 + 2 * SLOTS, ROW), dtype=torch.int64, device=dev)
        self._mine = _flat({"flags": export_buffer(flags), "outbox": export_buffer(self.outbox),
                            "gpu_uuid": gpu_uuid(dev)})  # fmt: skip
        self.flags = flags.view(torch.int64)
        self.recv_flags = [self.flags[s:] for s in range(SLOTS)]
        self.err = self.state[0]
        self.ctr_ctrl = self.state[1]
        self.ctr_sent = [self.state[2 + 2 * s] for s in range(SLOTS)]
        self.ctr_recv = [self.state[3 + 2 * s] for s in range(SLOTS)]

    def _map_peer(self, sock, deadline: float) -> None:
        """Send this rank's buffer descriptions (``self._mine``), map the FFN
        rank's control buffer and inbox from its answer."""
        remote = _exchange_desc(sock, self._mine, deadline, self.peer, self.timeout)
        if remote.get("status") != "ok":
            raise AFDPeerError(
                f"AFD {self.peer} could not map this rank's buffers: "
                f"{printable(remote.get('status'))}"
            )
        # This rank's own control buffer on the FFN rank (no other rank's).
        ctrl = import_buffer(_sub(remote, "ctrl"), CTRL_BYTES, "control buffer")
        ctrl = ctrl.view(torch.int64).view(CTRL_ROWS, ROW)
        self.inbox = import_buffer(_sub(remote, "inbox"), SLOTS * self.slot_bytes, "inbox")
        self.peer_gpu = remote.get("gpu_uuid")
        self.ctrl = ctrl
        self.ctrl_row = ctrl[0]
        self.data_flags = [ctrl[0, C_DATA + s :] for s in range(SLOTS)]

    # -- rejoin (connector_extra_config.ipc_rejoin) ---------------------------
    def _point_table(self) -> None:
        """Write the mapped FFN buffers' addresses into the pointer table (its
        address, the one the graphs hold, stays)."""
        entries = torch.zeros(ROW, dtype=torch.int64)
        entries[kernels.TABLE_CTRL] = self.ctrl.data_ptr()
        entries[kernels.TABLE_INBOX] = self.inbox.data_ptr()
        self.table.copy_(entries)

    def _remap(self, sock, deadline: float) -> None:
        """A re-handshake with a restarted FFN rank (on the thread that runs the
        forwards, the device idle): this rank's own buffers start clean (counters,
        error word, the data flags its loss poisoned) and are described again as
        they are - they do not move -, the new FFN rank's buffers are mapped and
        the pointer table points at them."""
        dev = self.ctx.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # the held step's work and the poison are done
        self.state.zero_()
        self.flags.zero_()
        self._send_off = [0] * SLOTS
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # clean before the FFN rank can write them
        self._map_peer(sock, deadline)
        self._point_table()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        logger.info("AFD: cuda_ipc device channel to %s mapped again (pointer table "
                    "updated)", self.peer)  # fmt: skip

    def hold(self) -> None:
        """The FFN rank is lost and the loss held: release this rank's own device waits
        (its flags), so that a replay in flight ends now instead of after timeout_s; its
        output is discarded."""
        if self.ctx.device.type != "cuda":
            self.flags[:SLOTS].fill_(POISON)
            return
        with torch.cuda.stream(self._side):
            self.flags[:SLOTS].fill_(POISON)

    def step_lost(self) -> str | None:
        """After a forward (its device work waited for): why its exchanges failed (a
        device wait that gave up: the error word), None when the pass was clean."""
        dev = self.ctx.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        seq = self._read_error_word()
        if seq:
            return (f"AFD peer {self.peer} did not answer within the timeout "
                    f"(timeout_s={self.timeout:g}, layer message {seq})")  # fmt: skip
        return None

    # -- per step (device work on the current stream) ---------------------
    def open_step(
        self, num_tokens: int, ubatch: tuple[int, int] | None, ubatch_tokens: list[int] | None
    ) -> None:
        """``ubatch``: (index, count) when this opens one micro-batch of a DBO
        step; micro-batch 0's message carries ``ubatch_tokens`` (the token
        counts of all of them), later micro-batches send no control message."""
        if ubatch is None:
            self._send_off[0] = 0
            self._control(num_tokens, 0, 0)
            return
        index, count = ubatch
        if count > SLOTS:
            raise AFDProtocolError(
                f"AFD cuda_ipc: {count} micro-batches per step, the connector has {SLOTS} slots"
            )
        self._send_off[index] = 0
        if index != 0:
            return
        if ubatch_tokens is None or len(ubatch_tokens) != count or ubatch_tokens[0] != num_tokens:
            raise AFDProtocolError(
                f"AFD cuda_ipc: micro-batch 0 of {num_tokens} tokens opened a DBO step with "
                f"micro-batch token counts {ubatch_tokens} (expected {count}, the first "
                f"{num_tokens})"
            )
        self._control(num_tokens, ubatch_flags(0, count), int(ubatch_tokens[1]))

    def _control(self, num_tokens: int, flags: int, ub1_tokens: int) -> None:
        if self.reruns_forward:
            kernels.control_via(self.ctr_ctrl, self.table, num_tokens, flags, ub1_tokens)
        else:
            kernels.control(self.ctr_ctrl, self.ctrl_row, num_tokens, flags, ub1_tokens)

    # ``lane``: the channel's; the slot of a micro-batch comes from vLLM's micro-batch id
    # of the thread (_slot_stream), the same value.
    def send(self, x: torch.Tensor, lane: int = 0) -> None:
        s, stream = self._slot_stream()
        with torch.cuda.stream(stream):
            dst = _view(self.inbox, self._send_off[s], x, s, self.slot_bytes)
            if self.reruns_forward:
                offset = s * self.slot_bytes + self._send_off[s]
                kernels.copy_via(x.contiguous(), self.table, offset)
                kernels.signal_via(self.ctr_sent[s], self.table, C_DATA + s)
            else:
                send_message(x, dst, self.ctr_sent[s], self.data_flags[s])
            self._send_off[s] += _align(dst.numel() * dst.element_size())

    def recv(self, out: torch.Tensor, lane: int = 0) -> torch.Tensor:
        recv_message(_view(self.outbox, 0, out, 0, self.slot_bytes), out, self.ctr_recv[0],
                     self.recv_flags[0], self.err, self.timeout_ns)  # fmt: skip
        self._send_off[0] = 0
        return out

    def recv_start(self, out: torch.Tensor, lane: int = 0):
        """DBO: wait for this micro-batch's reply on its own stream; the returned
        ``wait()`` (called when the micro-batch's thread resumes) makes the
        current stream wait for it."""
        s, stream = self._slot_stream()
        with torch.cuda.stream(stream):
            recv_message(_view(self.outbox, 0, out, s, self.slot_bytes), out, self.ctr_recv[s],
                         self.recv_flags[s], self.err, self.timeout_ns)  # fmt: skip
            done = torch.cuda.Event()
            done.record(stream)
        self._send_off[s] = 0

        def wait() -> torch.Tensor:
            torch.cuda.current_stream().wait_event(done)
            return out

        return wait

    def _slot_stream(self) -> tuple[int, torch.cuda.Stream]:
        """The micro-batch slot of this thread and the stream its exchange runs
        on: outside DBO slot 0 on the current stream; in a micro-batch thread its
        own side stream, made to wait for the work issued so far."""
        from vllm.v1.worker import ubatching

        current = torch.cuda.current_stream()
        if not ubatching.dbo_enabled():
            return 0, current
        s = ubatching.dbo_current_ubatch_id()
        stream = self._ub_streams[s]
        ready = torch.cuda.Event()
        ready.record(current)
        stream.wait_event(ready)
        return s, stream

    def shares_device(self) -> bool | None:
        """From the GPU UUIDs the two sides exchanged with their buffers."""
        mine = gpu_uuid(self.ctx.device)
        if not self.peer_gpu or not mine:
            return None
        return self.peer_gpu == mine

    # -- failure detection (the channel's watchdog) ------------------------------------
    def probe(self) -> str | None:
        """The error word: set by a device wait that gave up. A synchronising call
        during a capture would make it fail (global mode): skipped meanwhile."""
        seq = unless_capturing(self._read_error_word)
        if seq:
            return (
                f"AFD peer {self.peer} did not answer within the timeout "
                f"(timeout_s={self.timeout:g}, layer message {seq})"
            )
        return None

    def _read_error_word(self) -> int:
        with torch.cuda.stream(self._side):
            self._host_err.copy_(self.err[:1], non_blocking=True)
        self._side.synchronize()
        return int(self._host_err[0])


def _sub(d: dict, prefix: str) -> dict:
    p = prefix + "."
    return {k[len(p) :]: v for k, v in d.items() if k.startswith(p)}


def _flat(d: dict) -> dict:
    out = {}
    for name, sub in d.items():
        if isinstance(sub, dict):
            out.update({f"{name}.{k}": v for k, v in sub.items()})
        else:
            out[name] = sub
    return out


# ----------------------------------------------------------------- FFN side
class _Inbox:
    """One attention rank's buffers on its FFN rank. ``ctrl`` (its control row
    and its error word) and ``data`` (its inbox) are exported to that rank
    only, each alone in its segment; ``desc`` describes them (made once)."""

    def __init__(self, row: int, ctrl: torch.Tensor, data: torch.Tensor, desc: dict):
        self.row = row  # index of the rank among those this FFN rank serves
        self.ctrl = ctrl  # (CTRL_ROWS, ROW) int64
        self.data = data  # SLOTS regions of slot_bytes
        self.desc = desc
        self.outbox: torch.Tensor | None = None  # the attention rank's, mapped here
        self.flags: torch.Tensor | None = None  # the attention rank's flag row
        self.recv_off = [0] * SLOTS
        self.seen = 0  # control messages consumed
        # Per micro-batch slot, the data messages whose receive the host enqueued (its
        # mirror of the device counter, for input_ready); stale after a graph capture,
        # whose replays advance the device counters (read again then).
        self.expect = [0] * SLOTS
        self.ub_tokens: list[int] = []  # token counts of the DBO step being served
        self.next_ub = 1


class IPCFFNPlane(FFNPlane):
    """The FFN rank's side: per attention rank a control buffer and an inbox of its own,
    exported to that rank only; step control by device flags (``polls_steps``: the host
    polls the control buffers with small copies on a side stream), layer data by device
    waits and copies on the current stream."""

    graph_capable = True
    dbo_capable = True
    polls_steps = True
    # The host waits for a rank's layer input before it enqueues the receive (the channel's
    # _await_input): a rank that stops mid-step is dropped at its own deadline instead of
    # its device waits (up to timeout_s each, one per remaining layer) holding the pass.
    polls_inputs = True
    # Micro-batch 0's control message announces every micro-batch of a DBO step
    # (recv_control answers from it without waiting; see vllm.afd.ffn_runner).
    ubatch_controls_upfront = True

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.timeout = float(ctx.config.timeout_s)
        self.timeout_ns = _timeout_ns(ctx)
        self.slot_bytes = 0  # set with the buffers (message_bytes)
        self.ranks = sorted(ctx.config.attention_ranks_of(ctx.rank))
        self.inboxes: dict[int, _Inbox] = {}
        self.counters: torch.Tensor | None = None
        self._side = None  # the stream of the control polls (start)
        # Bumped whenever an attention rank (re)joins: graphs captured before
        # hold the device addresses of the previous session's buffers.
        self.generation = 0
        self.hot_poll = ctx.config.connector_extra_config.get("ffn_hot_poll", True)
        self._expect_stale = False  # a graph was captured since the mirrors were read

    def start(self) -> None:
        dev = self.ctx.device
        if dev.type != "cuda":
            raise RuntimeError("AFD cuda_ipc connector needs a CUDA device")
        self._make_buffers(dev)
        self._host = torch.zeros((len(self.ranks), CTRL_ROWS, ROW), dtype=torch.int64,
                                 pin_memory=True)  # fmt: skip
        self._side = torch.cuda.Stream(device=dev)
        kernels.require()

    def _make_buffers(self, dev: torch.device) -> None:
        """Per attention rank a control buffer and an inbox of its own, and this
        rank's device counters (never exported: per rank and micro-batch slot,
        two rows: data received, data sent)."""
        self.slot_bytes = message_bytes(self.ctx)
        k = len(self.ranks)
        self.counters = torch.zeros((2 * SLOTS * k, ROW), dtype=torch.int64, device=dev)
        for r, rank in enumerate(self.ranks):
            self.inboxes[rank] = self._new_inbox(r, dev)

    def _new_inbox(self, row: int, dev: torch.device) -> _Inbox:
        ctrl = exported_zeros(CTRL_BYTES, dev)
        data = exported_zeros(SLOTS * self.slot_bytes, dev)
        desc = _flat({"ctrl": export_buffer(ctrl), "inbox": export_buffer(data)})
        return _Inbox(row, ctrl.view(torch.int64).view(CTRL_ROWS, ROW), data, desc)

    def _session_inbox(self, rank: int) -> _Inbox:
        """The buffers of a new session of ``rank``: its first session takes those
        made at start; a rank that joins again (its server restarted) gets fresh
        ones, so that nothing the previous session's process may still write (it
        maps the old ones) reaches the new session, and a fresh error word. The old
        ones are never handed out again: each buffer has a memory pool of its own
        (exported_zeros), which no later allocation draws from."""
        box = self.inboxes[rank]
        if box.flags is None:
            return box
        self.inboxes[rank] = self._new_inbox(box.row, self.ctx.device)
        return self.inboxes[rank]

    def _counter(self, box: _Inbox, slot: int, sent: bool) -> torch.Tensor:
        return self.counters[2 * (box.row * SLOTS + slot) + int(sent)]

    def attach(self, link: Link, deadline: float) -> None:
        """Map the attention rank's buffers and give it its own (handshake thread)."""
        if self.ctx.device.type == "cuda":
            torch.accelerator.set_device_index(self.ctx.device.index or 0)
        sock, addr = link.sock, link.peer
        box = self._session_inbox(link.rank)
        n = unpack_hello_preamble(_recv_bytes(sock, HELLO_PREAMBLE.size, deadline, addr))
        remote = parse_hello(_recv_bytes(sock, n, deadline, addr))
        try:
            flags = import_buffer(_sub(remote, "flags"), FLAGS_BYTES, "flag row")
            outbox = import_buffer(_sub(remote, "outbox"), SLOTS * self.slot_bytes, "outbox")
        except Exception as e:  # noqa: BLE001 - answered, then the peer is refused
            _send_all(sock, pack_hello({"status": f"cannot map buffers: {e}"}), 5.0, addr)
            raise
        box.flags, box.outbox = flags.view(torch.int64), outbox
        self._reset(box)
        self.generation += 1
        reply = {"status": "ok", "gpu_uuid": gpu_uuid(self.ctx.device), **box.desc}
        _send_all(sock, pack_hello(reply), 5.0, addr)

    def _reset(self, box: _Inbox) -> None:
        """A new session of this rank: its control buffer (an error word and
        poison of the last session included) and device counters start again -
        before the reply, after which the rank may write its first control
        message. On the poll stream, after the poison of its last session."""
        r = box.row
        with torch.cuda.stream(self._side):
            box.ctrl.zero_()
            self.counters[2 * SLOTS * r : 2 * SLOTS * (r + 1)].zero_()
        torch.cuda.synchronize(self.ctx.device)
        box.seen = 0
        box.recv_off = [0] * SLOTS
        box.expect = [0] * SLOTS

    # -- serving -------------------------------------------------------------
    def poll_steps(self, sessions: list[tuple[int, str]]) -> list[tuple[int, object, str | None]]:
        """The new control messages of ``sessions``: one small copy of each rank's
        control buffer, read together. A rank whose error word is set (a device
        wait for its data gave up, or the rank wrote it) is named failed, alone."""
        boxes = [self.inboxes[rank] for rank, _ in sessions]
        with torch.cuda.stream(self._side):
            for box in boxes:
                self._host[box.row].copy_(box.ctrl, non_blocking=True)
        self._side.synchronize()
        host = self._host.tolist()
        out = []
        for (rank, name), box in zip(sessions, boxes):
            row, err = host[box.row][0], host[box.row][ERR_ROW][0]
            if err:
                out.append((rank, None, f"AFD {name} did not send layer data within "
                            f"timeout_s={self.timeout:g} (message {err})"))  # fmt: skip
                continue
            step = self._new_step(name, box, row)
            if step is not None:
                out.append((rank, *step))
        return out

    def _new_step(self, name: str, box: _Inbox, row: list[int]):
        """(Control, None) for the step ``row`` (a host copy of the rank's control row)
        announces, (None, why) for a broken protocol, None when there is none."""
        flag = row[C_FLAG]
        if flag <= box.seen or row[C_SEQ] != flag:
            return None  # nothing new, or the payload is not visible yet
        if flag != box.seen + 1:
            return None, f"AFD {name} broke the protocol: control message {flag} after {box.seen}"
        box.seen = flag
        ctrl = Control(MSG_STEP, flag, row[C_TOKENS], row[C_FLAGS])
        index, count = ubatch_of(ctrl.flags)
        box.ub_tokens = [ctrl.num_tokens]
        box.next_ub = 1
        if count:
            box.ub_tokens.append(row[C_UB1_TOKENS])
        bad = None
        if not all(0 < n <= self.ctx.max_num_tokens for n in box.ub_tokens):
            tokens = box.ub_tokens if count else ctrl.num_tokens
            bad = f"step with {tokens} tokens is outside 1..{self.ctx.max_num_tokens}"
        elif ctrl.flags and (index != 0 or not 2 <= count <= SLOTS):
            bad = f"step opened as micro-batch {index} of {count} (slots: {SLOTS})"
        if bad is not None:
            return None, f"AFD {name} broke the protocol: {bad}"
        box.recv_off = [0] * SLOTS
        return ctrl, None

    def recv_control(self, rank: int, control: Control) -> Control:
        """The next micro-batch of the DBO step ``control`` opened, from the token
        counts its control message announced (no wait)."""
        box = self.inboxes[rank]
        i = box.next_ub
        count = ubatch_of(control.flags)[1]
        if not i < count:
            raise AFDPeerError(
                f"AFD cuda_ipc: micro-batch {i} asked for, step {control.step_id} of "
                f"attention rank {rank} has {count}"
            )
        box.next_ub += 1
        return Control(MSG_STEP, control.step_id, box.ub_tokens[i], ubatch_flags(i, count))

    def release(self, link: Link | None) -> None:
        """Before a lost session is dropped (None: the FFN rank stops): its device waits
        end now (poisoned)."""
        if link is None:
            self.poison()
        elif link.rank in self.inboxes:
            self.poison([self.inboxes[link.rank]])

    def poison(self, boxes: list[_Inbox] | None = None) -> None:
        """Release the device waits of these ranks (default: all; their peers
        are gone)."""
        try:
            with torch.cuda.stream(self._side):
                for box in self.inboxes.values() if boxes is None else boxes:
                    box.ctrl[0, C_DATA : C_DATA + SLOTS].fill_(POISON)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass

    def recv(self, link: Link, out: torch.Tensor, lane: int = 0) -> None:
        box = self.inboxes[link.rank]
        s = lane
        src = _view(box.data, box.recv_off[s], out, s, self.slot_bytes)
        recv_message(src, out, self._counter(box, s, False), box.ctrl[0, C_DATA + s :],
                     box.ctrl[ERR_ROW], self.timeout_ns)  # fmt: skip
        box.recv_off[s] += _align(out.numel() * out.element_size())
        box.expect[s] += 1
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            self._expect_stale = True

    def input_ready(self, link: Link, lane: int = 0) -> bool:
        """The rank's data flag of slot ``lane`` reached the message its next receive
        waits for (one small copy of its control row on the poll stream). The host's count
        of the receives it enqueued is read again from the device counters after a graph
        capture (replays advance them on the device only)."""
        box = self.inboxes[link.rank]
        if self._expect_stale:
            self._read_expect()
        with torch.cuda.stream(self._side):
            self._host[box.row].copy_(box.ctrl, non_blocking=True)
        self._side.synchronize()
        flag = int(self._host[box.row][0][C_DATA + lane])
        return flag >= box.expect[lane] + 1

    def _read_expect(self) -> None:
        """Every rank's count of data messages received, from the device counters once the
        work enqueued so far is done."""
        dev = self.ctx.device
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        for box in self.inboxes.values():
            box.expect = [int(self._counter(box, s, False)[0]) for s in range(SLOTS)]
        self._expect_stale = False

    def send(self, link: Link, y: torch.Tensor, lane: int = 0) -> None:
        box = self.inboxes[link.rank]
        s = lane
        send_message(y, _view(box.outbox, 0, y, s, self.slot_bytes), self._counter(box, s, True),
                     box.flags[s:])  # fmt: skip
        box.recv_off[s] = 0


# The connectors: the control channel composed with the cuda_ipc plane. The names its
# tests (and the GPU tests) reach the plane's device state by are shown on the connectors.
IPCAttentionConnector, IPCFFNConnector = channel_connectors(
    IPCAttentionPlane, IPCFFNPlane, "IPC",
    exposes=(
        ("_make_own", "_map_peer", "_setup_device", "_point_table", "_remap", "_slot_stream",
         "_read_error_word", "table", "state", "flags", "outbox", "inbox", "ctrl", "peer_gpu",
         "slot_bytes", "timeout_ns"),
        ("_make_buffers", "_host", "_side", "inboxes", "slot_bytes", "counters", "ranks",
         "poison", "timeout_ns"),
    ),
)  # fmt: skip
register_connector("cuda_ipc", IPCAttentionConnector, IPCFFNConnector)
