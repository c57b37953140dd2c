# SPDX-License-Identifier: Apache-2.0
"""Wire format between attention and FFN ranks.

Nothing received from the network is unpickled or evaluated:

* hello: 8-byte preamble (magic ``AFDH`` + u32 length) then a JSON object of
  at most ``MAX_HELLO_BYTES`` (plain str/int/float/bool values only);
* control: one fixed-size little-endian struct (``CONTROL``) per message;
* data: raw tensor bytes whose size both sides derive from the control
  message and the agreed fingerprint, never from the data itself.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

HELLO_MAGIC = b"AFDH"
HELLO_PREAMBLE = struct.Struct("<4sI")
MAX_HELLO_BYTES = 64 * 1024
PROTOCOL_VERSION = 3  # 3: micro-batched (DBO) steps

# magic, type, step id, number of tokens, flags, reserved
CONTROL = struct.Struct("<4sIQIII")
CONTROL_MAGIC = b"AFDS"

MSG_STEP = 1
MSG_HEARTBEAT = 2
MSG_GOODBYE = 3
MSG_PROFILE = 4  # flags: 1 = start the FFN rank's profiler, 0 = stop it
# MSG_STEP flags: the micro-batch (DBO) a step-control message opens - bits 0-7
# its index, bits 8-15 the number of micro-batches of the step (0: the step is
# not micro-batched). The micro-batches of one step share its step id; the FFN
# rank serves them alternately, layer by layer, in index order.
MAX_UBATCHES = 8


def _is_ubatch(index: int, count: int) -> bool:
    return 2 <= count <= MAX_UBATCHES and 0 <= index < count


def ubatch_flags(index: int, count: int) -> int:
    if not _is_ubatch(index, count):
        raise ValueError(f"micro-batch {index} of {count} is outside 2..{MAX_UBATCHES}")
    return count << 8 | index


def ubatch_of(flags: int) -> tuple[int, int]:
    """(index, count) of a step-control message; (0, 0) when not micro-batched."""
    return flags & 0xFF, (flags >> 8) & 0xFF


MSG_TYPES = {
    MSG_STEP: "step",
    MSG_HEARTBEAT: "heartbeat",
    MSG_GOODBYE: "goodbye",
    MSG_PROFILE: "profile",
}

# Fingerprint keys that must agree between the two sides.
FINGERPRINT_KEYS = (
    "protocol",
    "architecture",
    "num_hidden_layers",
    "hidden_size",
    "ffn_layers",
    "ffn_blocks",
    "num_experts",
    "mlp_config",
    "dtype",
    "num_attention_ranks",
    "num_ffn_ranks",
    "connector",
    "compute_gate_on_attention",
    "max_num_tokens",
    "afd_revision",
    "checkpoint",
)


class AFDProtocolError(RuntimeError):
    """The peer sent something that is not this protocol."""


class AFDHandshakeError(RuntimeError):
    """The two sides do not belong to the same deployment."""


class AFDPeerError(RuntimeError):
    """The peer is gone, or did not answer within timeout_s."""


@dataclass(frozen=True)
class Control:
    type: int
    step_id: int = 0
    num_tokens: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        return CONTROL.pack(CONTROL_MAGIC, self.type, self.step_id, self.num_tokens, self.flags, 0)

    @classmethod
    def unpack(cls, data: bytes, max_num_tokens: int) -> Control:
        magic, mtype, step_id, num_tokens, flags, _ = CONTROL.unpack(data)
        if magic != CONTROL_MAGIC:
            raise AFDProtocolError(f"bad control magic {magic!r}")
        if mtype not in MSG_TYPES:
            raise AFDProtocolError(f"unknown control message type {mtype}")
        if mtype == MSG_STEP and not 0 < num_tokens <= max_num_tokens:
            raise AFDProtocolError(
                f"step with {num_tokens} tokens is outside 1..{max_num_tokens}"
            )
        if mtype == MSG_STEP and flags and (flags >> 16 or not _is_ubatch(*ubatch_of(flags))):
            raise AFDProtocolError(f"step with bad micro-batch flags {flags:#x}")
        return cls(mtype, step_id, num_tokens, flags)


def pack_hello(payload: dict) -> bytes:
    body = json.dumps(payload, sort_keys=True).encode()
    if len(body) > MAX_HELLO_BYTES:
        raise ValueError("hello message too large")
    return HELLO_PREAMBLE.pack(HELLO_MAGIC, len(body)) + body


def unpack_hello_preamble(data: bytes) -> int:
    magic, length = HELLO_PREAMBLE.unpack(data)
    if magic != HELLO_MAGIC:
        raise AFDProtocolError(f"not an AFD peer (preamble {data!r})")
    if length > MAX_HELLO_BYTES:
        raise AFDProtocolError(f"hello of {length} bytes exceeds {MAX_HELLO_BYTES}")
    return length


def parse_hello(body: bytes) -> dict:
    try:
        payload = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AFDProtocolError(f"hello is not JSON: {e}") from e
    if not isinstance(payload, dict):
        raise AFDProtocolError("hello is not a JSON object")
    scalar = (str, int, float, bool, type(None))
    for key, value in payload.items():
        if isinstance(value, list):
            if not all(isinstance(v, scalar) for v in value):
                raise AFDProtocolError(f"hello field {key!r} is a list of non-scalars")
        elif not isinstance(value, scalar):
            raise AFDProtocolError(f"hello field {key!r} has a non-scalar value")
    return payload


def fingerprint_mismatch(local: dict, remote: dict) -> str | None:
    """Return a message naming the first differing field, or None."""
    for key in FINGERPRINT_KEYS:
        if local.get(key) != remote.get(key):
            return (
                f"AFD fingerprint mismatch on '{key}': this side has "
                f"{local.get(key)!r}, the peer has {remote.get(key)!r}"
            )
    return None
