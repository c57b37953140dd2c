# SPDX-License-Identifier: Apache-2.0
"""Wire format between attention and FFN ranks.

Nothing received from the network is unpickled or evaluated:

* hello: 8-byte preamble (magic ``AFDH`` + u32 length) then a JSON object of
  at most ``MAX_HELLO_BYTES`` (plain str/int/float/bool values only); with a
  shared secret on both sides the handshake adds a challenge-response round
  (``auth_proof``, see docs/connectors.md);
* control: one fixed-size little-endian struct (``CONTROL``) per message;
* data: raw tensor bytes whose size both sides derive from the control
  message and the agreed fingerprint, never from the data itself.
"""

from __future__ import annotations

import hmac
import json
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

HELLO_MAGIC = b"AFDH"
HELLO_PREAMBLE = struct.Struct("<4sI")
MAX_HELLO_BYTES = 64 * 1024
# 3: micro-batched (DBO) steps; 4: challenge-response authentication (nonces,
# both sides prove the secret), step ids checked by the FFN rank
PROTOCOL_VERSION = 4

# Hello "status" values; any other status is a refusal (its text says why).
STATUS_OK = "ok"
STATUS_CHALLENGE = "challenge"  # FFN -> attention: prove the secret for this nonce
STATUS_BUSY = "busy"  # FFN -> attention: too many handshakes at once, try again
# Hello "auth" values: does this side hold a shared secret (and so require the
# other side to prove it)?
AUTH_REQUIRED = "required"
AUTH_NONE = "none"
NONCE_BYTES = 16

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
            raise AFDProtocolError(f"step with {num_tokens} tokens is outside 1..{max_num_tokens}")
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
    except (ValueError, RecursionError) as e:
        # ValueError: not UTF-8, not JSON, or an integer past Python's
        # int_max_str_digits; RecursionError: nested too deep.
        raise AFDProtocolError(f"hello is not JSON: {printable(str(e), 200)}") from e
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
                f"{shown(local.get(key))}, the peer has {shown(remote.get(key))}"
            )
    return None


def printable(text: object, limit: int = 300) -> str:
    """``text`` fit for a log line or an error message: control and other
    non-printable characters escaped (as in ``repr``), at most ``limit``
    characters of it kept. For text that came from a peer."""
    text = text if isinstance(text, str) else repr(text)
    kept = text[:limit]
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in kept)
    if len(text) > limit:
        out += f"... ({len(text)} characters)"
    return out


def shown(value: object, limit: int = 200) -> str:
    """``repr`` of a value from a peer, bounded (see ``printable``)."""
    return printable(repr(value), limit)


class LogThrottle:
    """At most one log line per ``every`` seconds; the next one counts the lines
    left out (what a peer can trigger at will must not fill the log)."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self._next = 0.0
        self._skipped = 0
        self._lock = threading.Lock()

    def __call__(self, log: Callable[..., None], msg: str, *args) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._skipped += 1
                return
            skipped, self._skipped = self._skipped, 0
            self._next = now + self.every
        if skipped:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, skipped, self.every)
        log(msg, *args)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def is_nonce(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == 2 * NONCE_BYTES
        and all(c in "0123456789abcdef" for c in value)
    )


def auth_proof(
    secret: str,
    prover: str,
    attention_rank: int,
    ffn_rank: int,
    attention_nonce: str,
    ffn_nonce: str,
) -> str:
    """HMAC-SHA256 by which ``prover`` ("attention" or "ffn") shows that it holds
    the shared secret, over both sides' fresh nonces of this connection (so a
    recorded answer is worth nothing on the next one) and whom it speaks for."""
    msg = "|".join((
        f"AFD-AUTH-v{PROTOCOL_VERSION}", prover, f"attention={attention_rank}",
        f"ffn={ffn_rank}", attention_nonce, ffn_nonce,
    ))  # fmt: skip
    return hmac.new(secret.encode(), msg.encode(), "sha256").hexdigest()


def proof_matches(expected: str, got: object) -> bool:
    """Constant-time comparison of a proof received from a peer (any JSON value)."""
    if not isinstance(got, str):
        return False
    return hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))
