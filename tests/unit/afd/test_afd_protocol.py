"""AFD wire format (overlay/vllm/afd/protocol.py), imported standalone by file path."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

PROTOCOL_PY = Path(__file__).resolve().parents[3] / "overlay" / "vllm" / "afd" / "protocol.py"


def _load():
    spec = importlib.util.spec_from_file_location("afd_protocol_under_test", PROTOCOL_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


P = _load()


def fingerprint(**changes) -> dict:
    fp = {
        "protocol": P.PROTOCOL_VERSION,
        "architecture": "LlamaForCausalLM",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "ffn_layers": [0, 1, 2, 3],
        "ffn_blocks": "0-3:LlamaMLP",
        "num_experts": None,
        "mlp_config": 'hidden_act="silu",intermediate_size=128',
        "dtype": "float32",
        "num_attention_ranks": 1,
        "num_ffn_ranks": 1,
        "connector": "gloo",
        "compute_gate_on_attention": False,
        "max_num_tokens": 256,
        "afd_revision": "test",
        "checkpoint": "0123456789abcdef01234567 (config.json + 1 safetensors file)",
    }
    assert set(fp) == set(P.FINGERPRINT_KEYS)
    fp.update(changes)
    return fp


def test_module_is_pure_python():
    src = PROTOCOL_PY.read_text()
    assert "import torch" not in src
    assert "from vllm" not in src and "import vllm" not in src
    assert "pickle" not in src.replace("unpickled", "")


# ------------------------------------------------------------------ control
def test_struct_sizes():
    assert P.CONTROL.size == 4 + 4 + 8 + 4 + 4 + 4
    assert P.HELLO_PREAMBLE.size == 8


@pytest.mark.parametrize(
    "ctrl",
    [
        P.Control(P.MSG_STEP, step_id=7, num_tokens=1),
        P.Control(P.MSG_STEP, step_id=2**64 - 1, num_tokens=256, flags=P.ubatch_flags(1, 3)),
        P.Control(P.MSG_PROFILE, flags=1),
        P.Control(P.MSG_HEARTBEAT),
        P.Control(P.MSG_GOODBYE),
    ],
)
def test_control_round_trip(ctrl):
    data = ctrl.pack()
    assert len(data) == P.CONTROL.size
    assert data[:4] == P.CONTROL_MAGIC
    assert P.Control.unpack(data, max_num_tokens=256) == ctrl


def test_control_is_little_endian():
    data = P.Control(P.MSG_STEP, step_id=1, num_tokens=2, flags=3).pack()
    assert data == b"AFDS" + struct.pack("<I", 1) + struct.pack("<Q", 1) + struct.pack(
        "<III", 2, 3, 0
    )


def test_control_heartbeat_and_goodbye_ignore_token_bound():
    # only step messages carry a token count
    for mtype in (P.MSG_HEARTBEAT, P.MSG_GOODBYE):
        data = P.CONTROL.pack(P.CONTROL_MAGIC, mtype, 0, 0, 0, 0)
        assert P.Control.unpack(data, 8).type == mtype


def test_control_bad_magic():
    data = P.CONTROL.pack(b"XXXX", P.MSG_STEP, 1, 1, 0, 0)
    with pytest.raises(P.AFDProtocolError, match=r"bad control magic b'XXXX'"):
        P.Control.unpack(data, 8)


@pytest.mark.parametrize("mtype", [0, 5, 99, 2**32 - 1])
def test_control_unknown_type(mtype):
    data = P.CONTROL.pack(P.CONTROL_MAGIC, mtype, 1, 1, 0, 0)
    with pytest.raises(P.AFDProtocolError, match=rf"unknown control message type {mtype}$"):
        P.Control.unpack(data, 8)


@pytest.mark.parametrize("num_tokens", [0, 9, 2**32 - 1])
def test_control_step_tokens_out_of_range(num_tokens):
    data = P.Control(P.MSG_STEP, 1, num_tokens).pack()
    with pytest.raises(
        P.AFDProtocolError, match=rf"step with {num_tokens} tokens is outside 1\.\.8"
    ):
        P.Control.unpack(data, 8)


def test_control_step_tokens_at_bounds():
    assert P.Control.unpack(P.Control(P.MSG_STEP, 1, 1).pack(), 8).num_tokens == 1
    assert P.Control.unpack(P.Control(P.MSG_STEP, 1, 8).pack(), 8).num_tokens == 8


@pytest.mark.parametrize("index, count", [(0, 2), (1, 2), (0, 8), (7, 8)])
def test_control_micro_batch_flags_round_trip(index, count):
    flags = P.ubatch_flags(index, count)
    got = P.Control.unpack(P.Control(P.MSG_STEP, 5, 3, flags).pack(), 8)
    assert P.ubatch_of(got.flags) == (index, count) and got.step_id == 5


def test_control_plain_step_is_not_micro_batched():
    assert P.ubatch_of(P.Control.unpack(P.Control(P.MSG_STEP, 1, 1).pack(), 8).flags) == (0, 0)


@pytest.mark.parametrize("index, count", [(0, 1), (2, 2), (0, 9), (-1, 2)])
def test_ubatch_flags_refuses_bad_micro_batches(index, count):
    with pytest.raises(ValueError, match="outside 2..8"):
        P.ubatch_flags(index, count)


@pytest.mark.parametrize("flags", [1 << 8 | 0, 2 << 8 | 2, 1, 9 << 8, 1 << 16 | 2 << 8])
def test_control_bad_micro_batch_flags(flags):
    data = P.Control(P.MSG_STEP, 1, 4, flags).pack()
    with pytest.raises(P.AFDProtocolError, match="bad micro-batch flags"):
        P.Control.unpack(data, 8)


def test_control_errors_are_protocol_errors():
    assert issubclass(P.AFDProtocolError, RuntimeError)
    assert issubclass(P.AFDHandshakeError, RuntimeError)
    assert issubclass(P.AFDPeerError, RuntimeError)


# -------------------------------------------------------------------- hello
def _split(packed: bytes) -> tuple[int, bytes]:
    n = P.unpack_hello_preamble(packed[: P.HELLO_PREAMBLE.size])
    return n, packed[P.HELLO_PREAMBLE.size :]


def test_hello_round_trip():
    payload = {**fingerprint(), "role": "attention", "rank": 0, "auth": "", "x": None, "f": 1.5}
    packed = P.pack_hello(payload)
    assert packed[:4] == P.HELLO_MAGIC
    n, body = _split(packed)
    assert n == len(body)
    assert P.parse_hello(body) == payload


def test_hello_is_sorted_json():
    _, body = _split(P.pack_hello({"b": 1, "a": 2}))
    assert body == json.dumps({"a": 2, "b": 1}).encode()


def test_hello_empty_object():
    n, body = _split(P.pack_hello({}))
    assert P.parse_hello(body) == {}
    assert n == 2


def test_hello_at_size_limit():
    # {"k": "<pad>"} is 9 bytes plus the padding
    payload = {"k": "x" * (P.MAX_HELLO_BYTES - 9)}
    packed = P.pack_hello(payload)
    n, body = _split(packed)
    assert n == P.MAX_HELLO_BYTES
    assert P.parse_hello(body) == payload


def test_pack_hello_too_large():
    with pytest.raises(ValueError, match="hello message too large"):
        P.pack_hello({"k": "x" * (P.MAX_HELLO_BYTES - 8)})


def test_preamble_bad_magic():
    with pytest.raises(P.AFDProtocolError, match=r"not an AFD peer \(preamble b'GET / HT'\)"):
        P.unpack_hello_preamble(b"GET / HT")


def test_preamble_control_magic_is_not_hello():
    with pytest.raises(P.AFDProtocolError, match="not an AFD peer"):
        P.unpack_hello_preamble(P.HELLO_PREAMBLE.pack(P.CONTROL_MAGIC, 2))


@pytest.mark.parametrize("length", [P.MAX_HELLO_BYTES + 1, 2**32 - 1])
def test_preamble_oversized_hello(length):
    data = P.HELLO_PREAMBLE.pack(P.HELLO_MAGIC, length)
    with pytest.raises(
        P.AFDProtocolError, match=rf"hello of {length} bytes exceeds {P.MAX_HELLO_BYTES}"
    ):
        P.unpack_hello_preamble(data)


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"\xff\xfe\x00", b"{'a': 1}"])
def test_hello_not_json(body):
    with pytest.raises(P.AFDProtocolError, match="hello is not JSON"):
        P.parse_hello(body)


@pytest.mark.parametrize("body", [b"[]", b"[1, 2]", b'"str"', b"3", b"null", b"true"])
def test_hello_not_an_object(body):
    with pytest.raises(P.AFDProtocolError, match=r"^hello is not a JSON object$"):
        P.parse_hello(body)


@pytest.mark.parametrize(
    "body, key",
    [
        (b'{"role": "attention", "nested": {"a": 1}}', "nested"),
        (b'{"x": {}}', "x"),
    ],
)
def test_hello_nested_object_rejected(body, key):
    with pytest.raises(P.AFDProtocolError, match=rf"hello field '{key}' has a non-scalar value"):
        P.parse_hello(body)


def test_hello_scalar_and_list_values_accepted():
    body = b'{"s": "a", "i": 1, "f": 1.5, "b": true, "n": null, "l": [1, 2]}'
    assert P.parse_hello(body)["l"] == [1, 2]


# -------------------------------------------------------------- fingerprint
def test_fingerprint_equal():
    assert P.fingerprint_mismatch(fingerprint(), fingerprint()) is None


def test_fingerprint_extra_keys_ignored():
    a = {**fingerprint(), "role": "attention", "rank": 0, "auth": "x"}
    b = {**fingerprint(), "role": "ffn", "rank": 3, "status": "ok"}
    assert P.fingerprint_mismatch(a, b) is None


@pytest.mark.parametrize("key", P.FINGERPRINT_KEYS)
def test_fingerprint_mismatch_names_key(key):
    remote = fingerprint(**{key: "DIFFERENT"})
    msg = P.fingerprint_mismatch(fingerprint(), remote)
    assert msg is not None
    assert msg.startswith(f"AFD fingerprint mismatch on '{key}': ")
    assert msg.endswith("the peer has 'DIFFERENT'")
    assert repr(fingerprint()[key]) in msg


def test_fingerprint_mismatch_names_first_differing_key():
    remote = fingerprint(num_hidden_layers=8, dtype="bfloat16", max_num_tokens=1)
    msg = P.fingerprint_mismatch(fingerprint(), remote)
    assert msg == (
        "AFD fingerprint mismatch on 'num_hidden_layers': this side has 4, the peer has 8"
    )
    # order follows FINGERPRINT_KEYS, not the dict order
    remote = fingerprint(afd_revision="other", protocol=999)
    assert "'protocol'" in P.fingerprint_mismatch(fingerprint(), remote)


def test_fingerprint_missing_key_is_a_mismatch():
    remote = fingerprint()
    del remote["hidden_size"]
    msg = P.fingerprint_mismatch(fingerprint(), remote)
    assert msg == "AFD fingerprint mismatch on 'hidden_size': this side has 64, the peer has None"


def test_fingerprint_type_matters():
    msg = P.fingerprint_mismatch(fingerprint(), fingerprint(hidden_size="64"))
    assert msg is not None and "'hidden_size'" in msg


def test_hello_list_of_objects_rejected():
    body = b'{"role": "attention", "ffn_layers": [0, {"a": 1}]}'
    with pytest.raises(P.AFDProtocolError, match="'ffn_layers' is a list of non-scalars"):
        P.parse_hello(body)


@pytest.mark.parametrize("start", [True, False])
def test_control_profile_round_trip(start):
    ctrl = P.Control(P.MSG_PROFILE, flags=int(start))
    got = P.Control.unpack(ctrl.pack(), 8)
    assert got.type == P.MSG_PROFILE and bool(got.flags) is start
    assert P.MSG_TYPES[P.MSG_PROFILE] == "profile"


# ------------------------------------------------ numbers and text from a peer
def test_hello_with_a_huge_integer_is_a_protocol_error():
    """Python refuses to convert integers past int_max_str_digits (ValueError)."""
    body = b'{"role": "attention", "rank": ' + b"7" * 5000 + b"}"
    with pytest.raises(P.AFDProtocolError, match="hello is not JSON: Exceeds the limit"):
        P.parse_hello(body)


def test_deeply_nested_hello_is_a_protocol_error():
    depth = 100_000
    with pytest.raises(P.AFDProtocolError, match="hello is not JSON"):
        P.parse_hello(b"[" * depth + b"]" * depth)


def test_printable_escapes_control_characters_and_bounds_length():
    text = "ok\nERROR forged\r\x1b[31m\u202e" + "x" * 1000
    shown = P.printable(text, limit=40)
    assert shown.startswith("ok\\nERROR forged\\r\\x1b[31m\\u202e")
    assert shown.endswith(f"... ({len(text)} characters)")
    assert all(c.isprintable() for c in shown) and len(shown) < 80
    assert P.printable(None) == "None" and P.printable("plain") == "plain"


def test_fingerprint_mismatch_bounds_a_peer_value():
    remote = fingerprint(architecture="A" * 10_000 + "\n")
    msg = P.fingerprint_mismatch(fingerprint(), remote)
    assert "'architecture'" in msg and "\n" not in msg and len(msg) < 400


# -------------------------------------------------------- authentication
def test_nonces_are_fresh_hex():
    a, b = P.new_nonce(), P.new_nonce()
    assert a != b and P.is_nonce(a) and len(a) == 2 * P.NONCE_BYTES
    for bad in (None, 5, "", "g" * 32, a.upper(), a + "0"):
        assert not P.is_nonce(bad)


def test_auth_proof_binds_prover_ranks_and_both_nonces():
    na, nf = P.new_nonce(), P.new_nonce()
    proof = P.auth_proof("secret", "attention", 0, 0, na, nf)
    assert P.proof_matches(proof, proof)
    others = [
        P.auth_proof("other", "attention", 0, 0, na, nf),
        P.auth_proof("secret", "ffn", 0, 0, na, nf),  # no reflection of one side's proof
        P.auth_proof("secret", "attention", 1, 0, na, nf),
        P.auth_proof("secret", "attention", 0, 1, na, nf),
        P.auth_proof("secret", "attention", 0, 0, na, P.new_nonce()),  # a replay
        P.auth_proof("secret", "attention", 0, 0, P.new_nonce(), nf),
    ]
    assert len({proof, *others}) == 7
    assert not any(P.proof_matches(proof, o) for o in others)


@pytest.mark.parametrize("got", [None, 5, ["x"], "\u00e9" * 64, "\ud800", ""])
def test_proof_matches_any_json_value_without_raising(got):
    assert not P.proof_matches(P.auth_proof("s", "ffn", 0, 0, "a" * 32, "b" * 32), got)
