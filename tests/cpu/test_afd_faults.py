"""Faults of a running AFD deployment of real `vllm serve` servers on the CPU, the fuzzing of
the FFN's AFD port, and start-up errors.

The tests of this module share one deployment (:class:`Deployment`): the same three ports
(attention HTTP, FFN HTTP, AFD) for its whole life, every server restarted on them, in the
order below (each test brings up the pair it needs if an earlier test left none):

1. fuzz of the AFD port without a shared secret, while completions run;
2. attention SIGKILLed while requests stream: the FFN notices, drops that attention rank
   and serves on; the attention server restarted alone is taken again;
3. the same fuzz with a shared secret, plus a real attention rank with the wrong secret;
4. FFN SIGKILLed and a new FFN started on its port: the old attention server fails its
   requests and ends; a new attention server and the new FFN then serve;
5. SIGTERM to the attention API server under 8 streams (``--shutdown-timeout``: drain);
6. SIGTERM to the FFN API server under 8 streams;
7. start-up errors (AFD port in use, unreachable FFN host) and forged hellos (harness FFN).

Every outcome is also bounded in time; after each fault no process of the failed servers
is left and their ports can be bound again. ``AFD_TIMEOUT_S`` is 30 s: two servers that
start together on this loaded 2-core machine reach the AFD connect up to ~20 s apart, and
each side waits ``timeout_s`` for the other. A dead peer is noticed at once (EOF or reset),
well inside that bound; the measured times are printed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import (
    AfdProc,
    TokenStream,
    join_streams,
    module_log_dir,
    request_after_peer_loss,
    wait_for,
    wait_healthy,
)
from oracle_lib import LOGPROB_TOL

import serve_util as su

pytestmark = pytest.mark.cpu_e2e

MODEL = "qwen3_moe"
AFD_TIMEOUT_S = 30.0
BOUND_S = AFD_TIMEOUT_S + 5  # a lost peer must be acted on within timeout_s + 5 s
START_TIMEOUT_S = 300.0
GROUP_DRAIN_S = 30.0  # children of an exited server must be gone within this
DRAIN_S = 60  # --shutdown-timeout of the attention server in the SIGTERM test

# Wire constants of vllm/afd/protocol.py, restated so that the fuzzer is independent of it.
HELLO_MAGIC = b"AFDH"
PREAMBLE = struct.Struct("<4sI")
MAX_HELLO = 64 * 1024
FINGERPRINT_KEYS = (
    "protocol", "architecture", "num_hidden_layers", "hidden_size", "ffn_layers", "ffn_blocks",
    "num_experts", "mlp_config", "dtype", "num_attention_ranks", "num_ffn_ranks", "connector",
    "compute_gate_on_attention", "max_num_tokens", "afd_revision", "checkpoint",
)  # fmt: skip

FUZZ_CONNECTIONS = 300
FUZZ_WALL_S = 60.0
CHECK_PROMPTS = ["Hello, my name is", "The capital of France is"]
CHECK_TOKENS = 12
CHECK_PARAMS = {"temperature": 0.0, "logprobs": 5, "ignore_eos": True,
                "return_tokens_as_token_ids": True}  # fmt: skip

# Figures and observations, printed at the end of the module and read by later tests.
FIGURES: dict[str, object] = {}
SECRET = os.urandom(16).hex()  # the shared secret of the deployment from test 2 on
DRAIN = ["--shutdown-timeout", str(DRAIN_S)]


def wait_until(pred, timeout: float, poll: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


# ---------------------------------------------------------------------------- deployment
class Deployment:
    """One attention server and one FFN server on fixed ports, restartable."""

    def __init__(self, model_dir: Path, log_dir: Path):
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.api_attn, self.api_ffn, self.afd_port = su.free_ports(3)
        self.attn: su.Server | None = None
        self.ffn: su.Server | None = None
        self.secret: str | None = None
        self.attn_extra: list[str] = []
        self.started: list[su.Server] = []
        self._n = 0

    @property
    def ports(self) -> list[int]:
        return [self.api_attn, self.api_ffn, self.afd_port]

    def start(
        self, role: str, *, secret: str | None = None, extra: list[str] | None = None
    ) -> su.Server:
        self._n += 1
        # rejoin_timeout_s 0: these tests check the fail-fast path (a lost FFN rank ends the
        # attention engine at once); its rejoin is tests/cpu/test_afd_restart.py.
        cfg = su.afd_config(role, port=self.afd_port, timeout_s=AFD_TIMEOUT_S,
                            rejoin_timeout_s=0)  # fmt: skip
        env = {"VLLM_AFD_SECRET": secret} if secret else {"VLLM_AFD_SECRET": ""}
        srv = su.Server.start(
            role, self.model_dir, self.api_attn if role == "attention" else self.api_ffn,
            self.log_dir / f"{self._n:02d}_{role}.log", afd_config=cfg, env=env,
            extra_args=extra,
        )  # fmt: skip
        self.started.append(srv)
        if role == "attention":
            self.attn = srv
            self.attn_extra = list(extra or [])
        else:
            self.ffn = srv
        return srv

    def wait_healthy(self, servers: list[su.Server]) -> dict[str, float]:
        return wait_healthy(servers, START_TIMEOUT_S)

    def restart_both(
        self, *, secret: str | None = None, attn_extra: list[str] | None = None
    ) -> dict[str, float]:
        """The recovery procedure: stop whatever is left, start both servers together."""
        self.stop_all()
        self.assert_released()
        self.secret = secret
        attn = self.start("attention", secret=secret, extra=attn_extra)
        ffn = self.start("ffn", secret=secret)
        ready = self.wait_healthy([attn, ffn])
        print(f"AFD pair healthy after {ready} (secret {'set' if secret else 'unset'})")
        return ready

    def ensure(self, *, secret: str | None = None, attn_extra: list[str] | None = None):
        """A healthy pair with this configuration (reused when the last one still is)."""
        ok = (
            self.attn is not None and self.ffn is not None
            and self.attn.alive() and self.ffn.alive()
            and self.attn.healthy() and self.ffn.healthy()
            and self.secret == secret and self.attn_extra == list(attn_extra or [])
        )  # fmt: skip
        if not ok:
            self.restart_both(secret=secret, attn_extra=attn_extra)
        return self.attn, self.ffn

    def stop_all(self) -> None:
        su.stop_servers(self.started)
        left = {s.log_path.name: su.group_members(s.pgid) for s in self.started}
        assert not any(left.values()), f"processes left after stop: {left}"

    def assert_released(self, servers: list[su.Server] | None = None) -> None:
        """No process left in the servers' groups (their leaders have exited; children get
        up to GROUP_DRAIN_S to follow), and all three ports can be bound."""
        for s in servers or self.started:
            assert s.proc.poll() is not None, f"{s.log_path.name}: server still running"
            t0 = time.monotonic()
            drained = wait_until(s.gone, GROUP_DRAIN_S)
            took = time.monotonic() - t0
            assert drained, f"{s.log_path.name}: processes left {su.group_members(s.pgid)}"
            if took > 0.5:
                print(f"{s.log_path.name}: last process of the group gone {took:.1f} s after "
                      "the server exited")  # fmt: skip
        busy = [p for p in self.ports if not su.port_bindable(p)]
        assert not busy, f"ports still taken: {busy}"


log_dir = module_log_dir("afd_faults_logs")


@pytest.fixture(scope="module")
def deploy(model_dir, log_dir):
    dep = Deployment(model_dir, log_dir)
    try:
        yield dep
    finally:
        dep.stop_all()
        dep.assert_released()
        print("\nfigures of test_afd_faults:")
        for k, v in FIGURES.items():
            print(f"  {k}: {v}")


# ---------------------------------------------------------------------------- helpers
def stories(srv: su.Server, n: int, max_tokens: int) -> list[TokenStream]:
    """``n`` concurrent greedy streams of ``max_tokens`` tokens, each with a token already."""
    streams = [TokenStream(srv, f"Story number {i}: once upon a time", max_tokens, timeout=120)
               for i in range(n)]  # fmt: skip
    wait_for(lambda: all(s.ids for s in streams), 120, "a token on every stream")
    return streams


def summary(streams: list[TokenStream], t0: float) -> list[str]:
    """Per stream: when it ended (relative to ``t0``), its chunks, finish reason and error."""
    return [f"{s.ended_at - t0:+.2f}s chunks={s.result['chunks']} "
            f"finish={s.result['finish_reason']} error={s.result['error']!r}"
            if s.result else "still running" for s in streams]  # fmt: skip


def log_text(srv: su.Server) -> str:
    return srv.log_path.read_text(errors="replace")


def check_completions(srv: su.Server) -> list[dict]:
    """Greedy completions of CHECK_PROMPTS: token ids and top-5 logprobs."""
    out = []
    for prompt in CHECK_PROMPTS:
        status, body = srv.completion(prompt, max_tokens=CHECK_TOKENS, timeout=120,
                                      **CHECK_PARAMS)  # fmt: skip
        assert status == 200, body
        choice = su.parse_choice(body)
        out.append({"ids": su.token_ids(choice["tokens"]), "top": choice["top_logprobs"]})
    return out


def assert_same(got: list[dict], want: list[dict]) -> None:
    for g, w, prompt in zip(got, want, CHECK_PROMPTS):
        assert g["ids"] == w["ids"], f"{prompt!r}: tokens differ"
        diff = su.max_logprob_diff(g["top"], w["top"])
        assert diff <= LOGPROB_TOL, f"{prompt!r}: max |logprob diff| {diff:.3g}"


def harness_proc(mode: str, model_dir: Path, log: Path, args: list[str],
                 secret: str | None) -> subprocess.Popen:
    """afd_proc.py (harness.AfdProc) with this shared secret (None: none); its Popen (the
    test waits on it and ends its process group itself)."""
    return AfdProc(mode, model_dir, log, args, env={"VLLM_AFD_SECRET": secret or ""}).p


# ---------------------------------------------------------------------------- fuzz
class _Unpickled:
    """Pickles to a payload that creates ``path`` when unpickled."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(_Unpickled(marker), protocol=2)


def hello(payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    return PREAMBLE.pack(HELLO_MAGIC, len(body)) + body


def read_reply(sock: socket.socket, timeout: float = 15.0) -> dict | None:
    """The FFN's hello reply, or None when it closed the connection without one."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while len(buf) < PREAMBLE.size:
            chunk = sock.recv(PREAMBLE.size - len(buf))
            if not chunk:
                return None
            buf += chunk
        magic, n = PREAMBLE.unpack(buf)
        assert magic == HELLO_MAGIC and n <= MAX_HELLO, buf
        body = b""
        while len(body) < n:
            chunk = sock.recv(n - len(body))
            if not chunk:
                return None
            body += chunk
    except ConnectionResetError:
        return None
    return json.loads(body)


def probe_fingerprint(port: int) -> dict:
    """The FFN's fingerprint, from its reply to a well-formed hello of a non-attention peer
    (the FFN answers every well-formed hello with its own fingerprint and a status)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(hello({"role": "probe", "rank": 0, "afd_revision": "probe"}))
        reply = read_reply(s)
    assert reply is not None and reply.get("role") == "ffn", reply
    assert reply["status"] != "ok", reply
    return {k: reply.get(k) for k in FINGERPRINT_KEYS}


def auth_token(secret: str, role: str, rank: int, revision: str) -> str:
    """The static token of protocol 3 (replayable): hostile input now."""
    return hmac.new(
        secret.encode(), f"{role}:{rank}:{revision}".encode(), hashlib.sha256
    ).hexdigest()


def attention_handshake(sock: socket.socket, payload: dict, secret: str | None) -> dict | None:
    """An attention hello as protocol 4 sends it; with a secret, the answer to the FFN's
    challenge (HMAC over both nonces). The FFN's last reply (None: dropped)."""
    from vllm.afd.protocol import AUTH_NONE, AUTH_REQUIRED, STATUS_CHALLENGE, auth_proof, new_nonce

    nonce = new_nonce()
    sock.sendall(hello({**payload, "nonce": nonce, "auth": AUTH_REQUIRED if secret else AUTH_NONE}))
    reply = read_reply(sock)
    if secret and reply is not None and reply.get("status") == STATUS_CHALLENGE:
        proof = auth_proof(secret, "attention", payload["rank"], 0, nonce, reply["nonce"])
        sock.sendall(hello({"proof": proof}))
        reply = read_reply(sock)
    return reply


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-(2**70), 2**70)
    if kind == 1:
        return rng.choice([None, True, False, 1e308, -0.0, "x" * rng.randrange(64)])
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(16)))
    if kind == 3:
        return rng.random()
    if kind == 4:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{rng.randrange(99)}": _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


# Roles a stranger may claim without a secret configured: never "attention". A hello as an
# attention rank is refused and logged and the FFN serves on; with the real rank connected it
# is a different case (the rank's slot is taken), which
# test_forged_attention_hello_does_not_end_an_ffn covers on its own.
STRANGER_ROLES = ["probe", "ffn", "", "ATTENTION", "attention ", None, 7, ["attention"]]


class Fuzzer:
    """Seeded hostile clients of the FFN's AFD port. Every case sends what it sends and
    either closes, holds the connection open (half-open), or reads the FFN's reply."""

    def __init__(
        self, port: int, seed: int, marker: Path, fingerprint: dict, secret_configured: bool
    ):
        self.port = port
        self.rng = random.Random(seed)
        self.marker = marker
        self.fingerprint = fingerprint
        self.secret_configured = secret_configured
        self.held: list[socket.socket] = []
        self.counts: dict[str, int] = {}
        self.replies: dict[str, list[str]] = {}
        self.errors: list[str] = []
        self.cases = [
            self.random_bytes, self.magic_then_garbage, self.garbage_json, self.non_object_json,
            self.deep_json, self.oversized_length, self.truncated_hello, self.pickle_raw,
            self.pickle_as_hello, self.random_hello, self.duplicate_rank, self.half_open_silent,
            self.connect_close, self.partial_preamble_hold, self.http_request,
        ]  # fmt: skip
        if secret_configured:
            self.cases += [self.forged_attention_wrong_secret, self.forged_attention_no_auth,
                           self.forged_attention_non_ascii_auth]  # fmt: skip

    # -- cases: each returns (bytes to send, what to do after: "close", "hold", "reply")
    def random_bytes(self):
        data = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 4096)))
        if data[:4] == HELLO_MAGIC:
            data = b"X" + data
        return data, "close"

    def magic_then_garbage(self):
        n = self.rng.randrange(0, MAX_HELLO + 1)
        junk = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(0, 512)))
        return PREAMBLE.pack(HELLO_MAGIC, n) + junk, "close"

    def garbage_json(self):
        body = self.rng.choice([b"{", b"{]x", b"\xff\xfe\x00{", b'{"role": "attention"', b"nan",
                                b'{"a": 1}}', "\u2603".encode("utf-16")])  # fmt: skip
        return PREAMBLE.pack(HELLO_MAGIC, len(body)) + body, "close"

    def non_object_json(self):
        body = json.dumps(self.rng.choice([[1, 2], "hello", 42, None, [{"role": "attention"}]]))
        return PREAMBLE.pack(HELLO_MAGIC, len(body)) + body.encode(), "close"

    def deep_json(self):
        depth = self.rng.randrange(1000, 30000)
        body = (b"[" * depth + b"]" * depth)[:MAX_HELLO]
        return PREAMBLE.pack(HELLO_MAGIC, len(body)) + body, "close"

    def oversized_length(self):
        n = self.rng.choice([MAX_HELLO + 1, 2**31, 2**32 - 1, self.rng.randrange(MAX_HELLO + 1,
                                                                                2**32)])  # fmt: skip
        return PREAMBLE.pack(HELLO_MAGIC, n) + b"{" * self.rng.randrange(64), "close"

    def truncated_hello(self):
        full = hello({"role": "probe", "rank": 0, "afd_revision": "x", "pad": "y" * 200})
        return full[: self.rng.randrange(PREAMBLE.size, len(full) - 1)], "close"

    def pickle_raw(self):
        return pickle_payload(self.marker), "close"

    def pickle_as_hello(self):
        body = pickle_payload(self.marker)
        return PREAMBLE.pack(HELLO_MAGIC, len(body)) + body, "close"

    def random_hello(self):
        payload = {f"f{i}": _random_json(self.rng) for i in range(self.rng.randrange(6))}
        if self.rng.random() < 0.7:
            payload.update({k: v for k, v in self.fingerprint.items() if self.rng.random() < 0.5})
        payload["role"] = self.rng.choice(STRANGER_ROLES)
        payload["rank"] = self.rng.choice([0, 1, -1, 2**40, "0", None, True, 0.5])
        if self.rng.random() < 0.8:
            payload["afd_revision"] = self.rng.choice(
                [self.fingerprint["afd_revision"], "other", 3]
            )
        return hello(payload), "reply"

    def duplicate_rank(self):
        """A well-formed attention hello for the slot that is taken (refused, not fatal)."""
        payload = {**self.fingerprint, "role": "attention", "rank": 0}
        if self.secret_configured:
            return self.forged_attention_wrong_secret()
        return hello(payload), "reply"

    def forged_attention_wrong_secret(self):
        rank = self.rng.choice([0, 0, 1, 99])
        payload = {**self.fingerprint, "role": "attention", "rank": rank}
        if self.rng.random() < 0.5:
            payload["num_hidden_layers"] = 99  # would be fatal if it got past the secret
        payload["auth"] = auth_token("not-the-secret", "attention", rank,
                                     str(payload["afd_revision"]))  # fmt: skip
        return hello(payload), "reply"

    def forged_attention_no_auth(self):
        payload = {**self.fingerprint, "role": "attention", "rank": 0, "num_hidden_layers": 99}
        return hello(payload), "reply"

    def forged_attention_non_ascii_auth(self):
        payload = {**self.fingerprint, "role": "attention", "rank": 0, "auth": "\u00e9" * 64}
        return hello(payload), "close"

    def half_open_silent(self):
        return b"", "hold"

    def connect_close(self):
        return b"", "close"

    def partial_preamble_hold(self):
        return PREAMBLE.pack(HELLO_MAGIC, 100)[: self.rng.randrange(1, PREAMBLE.size)], "hold"

    def http_request(self):
        return b"GET / HTTP/1.1\r\nHost: afd\r\n\r\n", "close"

    # -- driver
    def one(self) -> None:
        case = self.rng.choice(self.cases)
        name = case.__name__
        data, after = case()
        self.counts[name] = self.counts.get(name, 0) + 1
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        except OSError as e:
            self.errors.append(f"{name}: connect failed: {e}")
            return
        try:
            if data:
                s.sendall(data)
            if after == "hold":
                self.held.append(s)
                return
            if after == "reply":
                reply = read_reply(s)
                status = "no reply (dropped)" if reply is None else str(reply.get("status"))
                self.replies.setdefault(name, []).append(status)
                if reply is not None:
                    assert reply.get("role") == "ffn" and reply.get("status") != "ok", reply
        except (BrokenPipeError, ConnectionResetError):
            pass  # dropped while we were sending: fine
        except TimeoutError:
            self.errors.append(f"{name}: neither answered nor closed within 15 s")
        if after != "hold":
            s.close()

    def run(self, n: int, wall_s: float) -> tuple[int, float]:
        t0 = time.monotonic()
        done = 0
        while done < n and time.monotonic() - t0 < wall_s:
            self.one()
            done += 1
        return done, time.monotonic() - t0

    def reaped_held(self, timeout: float) -> tuple[int, int]:
        """(closed by the FFN, still open) among the held half-open connections."""
        closed = 0
        deadline = time.monotonic() + timeout
        for s in self.held:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                if s.recv(1) == b"":
                    closed += 1
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
            finally:
                s.close()
        return closed, len(self.held) - closed


def run_fuzz_against(deploy: Deployment, tmp_path: Path, *, seed: int, secret: str | None):
    attn, ffn = deploy.ensure(secret=secret)
    baseline = check_completions(attn)
    marker = tmp_path / "UNPICKLED"
    # The payload is live: unpickling it in a throwaway interpreter creates its file.
    probe_marker = tmp_path / "payload_is_live"
    payload_file = tmp_path / "payload.pkl"
    payload_file.write_bytes(pickle_payload(probe_marker))
    subprocess.run([sys.executable, "-c", "import pickle, sys; "
                    "pickle.loads(open(sys.argv[1], 'rb').read())", str(payload_file)],
                   check=True, timeout=60)  # fmt: skip
    assert probe_marker.exists(), "the pickle payload does not work: the test proves nothing"

    offsets = {s.name: len(log_text(s)) for s in (attn, ffn)}
    fingerprint = probe_fingerprint(deploy.afd_port)
    fuzz = Fuzzer(deploy.afd_port, seed, marker, fingerprint, secret_configured=bool(secret))

    # completions keep running during the fuzz and must equal the baseline
    stop = threading.Event()
    during: list = []

    def keep_generating():
        while not stop.is_set():
            try:
                during.append(check_completions(attn))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                during.append(e)
                return

    gen = threading.Thread(target=keep_generating, daemon=True)
    gen.start()
    sent, wall = fuzz.run(FUZZ_CONNECTIONS, FUZZ_WALL_S)
    stop.set()
    gen.join(180)
    assert not gen.is_alive(), "completions hung during the fuzz"
    closed, still_open = fuzz.reaped_held(timeout=15.0)
    print(f"fuzz seed {seed} (secret {'set' if secret else 'unset'}): {sent} connections in "
          f"{wall:.1f} s; cases {dict(sorted(fuzz.counts.items()))}")  # fmt: skip
    print(f"  replies: { {k: sorted(set(v)) for k, v in fuzz.replies.items()} }")
    print(f"  {len(during)} rounds of completions during the fuzz; held half-open connections "
          f"closed by the FFN: {closed}, still open: {still_open}")  # fmt: skip
    FIGURES[f"fuzz_{'secret' if secret else 'nosecret'}"] = (
        f"{sent} connections in {wall:.1f} s, {len(during)} completion rounds during it, "
        f"{closed}/{closed + still_open} half-open reaped"
    )

    assert sent >= min(FUZZ_CONNECTIONS, 100), f"only {sent} fuzz connections in {wall:.0f} s"
    assert not fuzz.errors, fuzz.errors[:10]
    for item in during:
        assert not isinstance(item, BaseException), f"completion failed during the fuzz: {item!r}"
        assert_same(item, baseline)
    assert during, "no completion finished during the fuzz"
    assert_same(check_completions(attn), baseline)
    assert attn.alive() and ffn.alive()
    assert not marker.exists(), "a pickle sent to the AFD port was unpickled"
    assert still_open == 0, f"{still_open} half-open connections never dropped by the FFN"
    ffn_new = log_text(ffn)[offsets["ffn"] :]
    attn_new = log_text(attn)[offsets["attention"] :]
    for name, text in (("ffn", ffn_new), ("attention", attn_new)):
        for bad in ("Traceback", "serve loop stopped", "EngineDeadError", "AFD-FFN-FAILED",
                    "AFD FFN rank failed"):
            assert bad not in text, f"{name} log after the fuzz has {bad!r}"
    # forged attention hellos are refused (and logged) without ending the FFN
    dropped = ffn_new.count("AFD: dropped connection from") + ffn_new.count(
        "AFD: refused attention hello")
    assert dropped >= sent // 3, f"the FFN logged only {dropped} dropped connections"
    return fuzz, ffn_new


# ---------------------------------------------------------------------------- tests
def test_fuzz_afd_port_without_secret(deploy, tmp_path):
    fuzz, ffn_log = run_fuzz_against(deploy, tmp_path, seed=20261201, secret=None)
    assert "attention rank 0 is already connected" in fuzz.replies.get("duplicate_rank", [""])


def test_attention_killed_ffn_serves_on_and_takes_the_restarted_one(deploy):
    """The FFN rank survives the loss of its attention rank (before: it ended and
    both servers had to be restarted); the attention server restarted alone rejoins it."""
    attn, ffn = deploy.ensure(secret=None)
    want = check_completions(attn)
    streams = stories(attn, 2, max_tokens=480)
    accepted = log_text(ffn).count("accepted attention rank 0")
    t_kill = time.monotonic()
    attn.kill()  # SIGKILL to the whole process group: API server, engine core, worker
    assert attn.gone()
    lost = "lost attention rank 0 (lost AFD peer attention rank 0 at 127.0.0.1:"
    assert wait_until(lambda: lost in log_text(ffn), BOUND_S), su.log_tail(ffn.log_path)
    noticed = time.monotonic() - t_kill
    assert not join_streams(streams, 30), "streams of the killed server did not end"
    line = next(ln for ln in log_text(ffn).splitlines() if lost in ln)
    print(f"FFN dropped attention rank 0 {noticed:.2f} s after the kill: {line.strip()}")
    assert ffn.alive() and ffn.healthy(), su.log_tail(ffn.log_path)
    assert wait_until(lambda: su.port_bindable(deploy.api_attn), GROUP_DRAIN_S)

    t0 = time.monotonic()
    attn = deploy.start("attention", secret=None)
    deploy.wait_healthy([attn])
    again = log_text(ffn).count("accepted attention rank 0")
    assert again == accepted + 1, su.log_tail(ffn.log_path)
    assert_same(check_completions(attn), want)
    FIGURES["attention_killed: FFN dropped the rank after"] = f"{noticed:.2f} s"
    FIGURES["attention_killed: restarted attention server serving after"] = (
        f"{time.monotonic() - t0:.0f} s (the FFN server never stopped)"
    )
    assert ffn.alive()


def test_fuzz_afd_port_with_secret_and_wrong_secret_refused(deploy, tmp_path, model_dir):
    secret = SECRET
    # a real attention rank (the offline harness) with the wrong secret, during the fuzz
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["Hello"], "max_tokens": [4]}))
    attn, ffn = deploy.ensure(secret=secret)
    wrong_log = tmp_path / "wrong_secret_attention.log"
    wrong = harness_proc(
        "attention", model_dir, wrong_log,
        ["--prompts", str(prompts), "--out", str(tmp_path / "wrong.json"),
         "--afd", json.dumps(su.afd_config("attention", port=deploy.afd_port, timeout_s=10))],
        "not-" + secret,
    )  # fmt: skip
    try:
        fuzz, ffn_log = run_fuzz_against(deploy, tmp_path, seed=4242, secret=secret)
        assert su.wait_for_exit(wrong, START_TIMEOUT_S) is not None, "wrong-secret rank hangs"
    finally:
        if wrong.poll() is None:
            os.killpg(wrong.pid, signal.SIGKILL)
        wrong.wait(30)
    assert not su.group_members(wrong.pid)
    out = wrong_log.read_text(errors="replace")
    refused = "refused this attention rank: authentication failed (shared secret differs)"
    assert wrong.returncode != 0, out[-3000:]
    assert refused in out, out[-3000:]
    assert not (tmp_path / "wrong.json").exists()
    line = next(ln for ln in out.splitlines() if refused in ln)
    print(f"wrong-secret attention (rc={wrong.returncode}): {line.strip()[-220:]}")
    ffn_text = log_text(ffn)
    assert "bad shared secret" in ffn_text
    statuses = {s for k, v in fuzz.replies.items() if k.startswith("forged") for s in v}
    assert statuses and all(s.startswith("authentication failed") for s in statuses), statuses
    # the deployment still serves (and still equals its own output before the fuzz)
    status, body = attn.completion("Hello", max_tokens=4, timeout=60)
    assert status == 200, body
    assert attn.alive() and ffn.alive()


def test_ffn_killed_new_ffn_on_same_port_then_new_attention(deploy):
    attn, ffn = deploy.ensure(secret=deploy.secret)
    secret = deploy.secret
    streams = stories(attn, 2, max_tokens=480)
    t_kill = time.monotonic()
    ffn.kill()
    assert ffn.gone()
    new_ffn = deploy.start("ffn", secret=secret)  # on the same AFD port, at once
    assert not join_streams(streams, BOUND_S), f"streams still running: {summary(streams, t_kill)}"
    ended = max(s.ended_at for s in streams) - t_kill
    print(f"in-flight streams after the FFN kill: {summary(streams, t_kill)}")
    for res in (s.result for s in streams):
        assert res["error"] and res["finish_reason"] != "length", res
    # a new request fails at once (HTTP error) or is refused (the server is on its way out)
    t0 = time.monotonic()
    outcome = request_after_peer_loss(attn, BOUND_S)
    t_req = time.monotonic() - t0
    assert t_req <= BOUND_S, t_req
    exited = su.wait_for_exit(attn.proc, BOUND_S)
    assert exited is not None, f"old attention server still up {BOUND_S:.0f} s after the FFN kill"
    t_exit = time.monotonic() - t_kill
    text = log_text(attn)
    lost = f"lost AFD peer FFN rank 0 at 127.0.0.1:{deploy.afd_port}"
    assert lost in text, su.log_tail(attn.log_path)
    assert "accepted attention rank" not in log_text(new_ffn)  # the old one never reconnects
    assert attn.proc.returncode == 1, su.log_tail(attn.log_path)  # its engine died
    deploy.assert_released([attn])
    FIGURES["ffn_killed: in-flight streams ended after"] = f"{ended:.2f} s"
    FIGURES["ffn_killed: next request"] = f"{outcome} in {t_req:.2f} s"
    FIGURES["ffn_killed: old attention server exited after"] = (
        f"{t_exit:.2f} s, rc={attn.proc.returncode}"
    )
    print(
        f"next request: {outcome} ({t_req:.2f} s); old attention exited {t_exit:.2f} s "
        f"after the kill, rc={attn.proc.returncode}"
    )

    # recovery: the new FFN is up; start a new attention server (both now restarted). It
    # drains on SIGTERM (--shutdown-timeout), which the next test needs.
    t0 = time.monotonic()
    new_attn = deploy.start("attention", secret=secret, extra=DRAIN)
    deploy.wait_healthy([new_attn, new_ffn])
    status, body = new_attn.completion("Hello", max_tokens=4, timeout=60)
    assert status == 200, body
    assert "accepted attention rank 0" in log_text(new_ffn)
    FIGURES["ffn_killed: new attention + new FFN serving after"] = f"{time.monotonic() - t0:.0f} s"


def test_sigterm_attention_under_load_drains(deploy):
    """SIGTERM to the attention API server (``--shutdown-timeout``, i.e. drain) while 8
    requests stream: all complete, the server exits, the FFN logs the goodbye and serves
    the next attention server. (With the default --shutdown-timeout 0, vLLM 0.26 leaves
    streaming requests hanging after SIGTERM, AFD or not: see docs/operations.md.)"""
    secret = deploy.secret
    attn, ffn = deploy.ensure(secret=secret, attn_extra=DRAIN)
    goodbyes_before = log_text(ffn).count("said goodbye")

    # Long enough that none ends before the last one starts (160 tokens did not, once, on a
    # fast machine: one stream had all 160 before another had its first); the drain then
    # takes a few seconds more.
    streams = stories(attn, 8, max_tokens=480)
    at_term = [len(s.ids) for s in streams]
    assert not any(s.result for s in streams), (
        f"a stream finished before the SIGTERM: make them longer ({at_term} tokens)")
    t_term = time.monotonic()
    os.kill(attn.proc.pid, signal.SIGTERM)  # the API server process only
    assert not join_streams(streams, DRAIN_S + 5), (
        f"streams hang after SIGTERM: {summary(streams, t_term)}")
    ended = max(s.ended_at for s in streams) - t_term
    print(f"streams after SIGTERM (tokens at SIGTERM {at_term}): {summary(streams, t_term)}")
    for res in (s.result for s in streams):
        assert res["error"] is None and res["finish_reason"] == "length" and res["done"], res
    exited = su.wait_for_exit(attn.proc, DRAIN_S + 15)
    assert exited is not None, "attention API server did not exit after SIGTERM"
    t_exit = time.monotonic() - t_term
    assert wait_until(attn.gone, 20), su.group_members(attn.pgid)
    assert su.port_bindable(deploy.api_attn)
    goodbye = wait_until(lambda: log_text(ffn).count("said goodbye") > goodbyes_before, BOUND_S)
    lost = "lost AFD peer attention rank 0" in log_text(ffn)
    FIGURES["sigterm_attention (drain): streams ended after"] = f"{ended:.2f} s, all completed"
    FIGURES["sigterm_attention (drain): API server exited after"] = (
        f"{t_exit:.2f} s, rc={attn.proc.returncode}"
    )
    FIGURES["sigterm_attention (drain): FFN saw"] = (
        "goodbye" if goodbye else "lost peer" if lost else "nothing"
    )
    print(f"attention exited {t_exit:.2f} s after SIGTERM (rc={attn.proc.returncode}); FFN saw "
          f"{FIGURES['sigterm_attention (drain): FFN saw']}")  # fmt: skip
    assert goodbye and not lost, su.log_tail(ffn.log_path)
    assert attn.proc.returncode == 0

    # the FFN keeps serving: a new attention server connects to it and generates
    assert ffn.alive()
    new_attn = deploy.start("attention", secret=secret)
    deploy.wait_healthy([new_attn])
    status, body = new_attn.completion("Hello", max_tokens=4, timeout=60)
    assert status == 200, body


def test_sigterm_ffn_under_load(deploy):
    attn, ffn = deploy.ensure(secret=deploy.secret)
    streams = stories(attn, 8, max_tokens=480)
    t_term = time.monotonic()
    os.kill(ffn.proc.pid, signal.SIGTERM)  # the FFN API server process only
    assert not join_streams(streams, BOUND_S), f"streams still running: {summary(streams, t_term)}"
    ended = max(s.ended_at for s in streams) - t_term
    print(f"streams after the FFN SIGTERM: {summary(streams, t_term)}")
    for res in (s.result for s in streams):
        assert res["error"] and res["finish_reason"] != "length", res
    assert ended <= BOUND_S
    ffn_exit = su.wait_for_exit(ffn.proc, BOUND_S)
    assert ffn_exit is not None, "FFN server did not exit after SIGTERM"
    t_ffn = time.monotonic() - t_term
    assert ffn.proc.returncode == 0, su.log_tail(ffn.log_path)
    attn_exit = su.wait_for_exit(attn.proc, BOUND_S)
    assert attn_exit is not None, "attention server still up after its FFN stopped"
    t_attn = time.monotonic() - t_term
    lost = f"lost AFD peer FFN rank 0 at 127.0.0.1:{deploy.afd_port}"
    text = log_text(attn)
    assert lost in text, su.log_tail(attn.log_path)
    assert attn.proc.returncode == 1, su.log_tail(attn.log_path)  # its engine died
    line = next(ln for ln in text.splitlines() if lost in ln)
    print(f"attention log: {line.strip()[:260]}")
    deploy.assert_released([attn, ffn])
    FIGURES["sigterm_ffn: streams failed after"] = (
        f"{ended:.2f} s with {streams[0].result['error']!r}"
    )
    FIGURES["sigterm_ffn: FFN exited after"] = f"{t_ffn:.2f} s rc={ffn.proc.returncode}"
    FIGURES["sigterm_ffn: attention exited after"] = f"{t_attn:.2f} s rc={attn.proc.returncode}"


# ---------------------------------------------------------------------------- start-up
def test_startup_errors_port_in_use_and_unreachable_host(model_dir, log_dir):
    """Two `vllm serve` start-ups at once: an FFN whose AFD port is taken, and an attention
    server whose FFN host (192.0.2.1, TEST-NET-1) cannot be reached, timeout_s 3."""
    api_ffn, api_attn, busy_port, far_port = su.free_ports(4)
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", busy_port))
    blocker.listen(1)
    servers: list[su.Server] = []
    try:
        ffn = su.Server.start(
            "ffn",
            model_dir,
            api_ffn,
            log_dir / "busy_ffn.log",
            afd_config=su.afd_config("ffn", port=busy_port, timeout_s=30),
        )
        servers.append(ffn)
        attn = su.Server.start(
            "attention", model_dir, api_attn, log_dir / "far_attention.log",
            afd_config=su.afd_config("attention", port=far_port, host="192.0.2.1",
                                     timeout_s=3),
        )  # fmt: skip
        servers.append(attn)
        # attention: from "AFD: connecting" to the exit
        t_conn = su.wait_for_log(attn.log_path, "AFD: connecting to FFN rank 0 at 192.0.2.1",
                                 START_TIMEOUT_S, proc=attn.proc)  # fmt: skip
        assert t_conn is not None, su.log_tail(attn.log_path)
        t0 = time.monotonic()
        assert su.wait_for_exit(attn.proc, 3 + 30) is not None, "attention did not give up"
        gave_up = time.monotonic() - t0
        assert attn.proc.returncode != 0
        want = f"could not reach AFD FFN rank 0 at 192.0.2.1:{far_port} within timeout_s=3"
        text = attn.log_path.read_text(errors="replace")
        assert want in text, su.log_tail(attn.log_path)
        print(
            f"unreachable FFN host: exit rc={attn.proc.returncode} {gave_up:.1f} s after "
            f"'connecting'; {next(ln for ln in text.splitlines() if want in ln)[-260:]}"
        )
        assert gave_up <= 3 + 15, gave_up

        want = f"AFD FFN rank 0 cannot listen on 127.0.0.1:{busy_port}"
        t_msg = su.wait_for_log(ffn.log_path, want, START_TIMEOUT_S, proc=ffn.proc)
        assert t_msg is not None, su.log_tail(ffn.log_path)
        t0 = time.monotonic()
        assert su.wait_for_exit(ffn.proc, 30) is not None, "FFN did not exit after the error"
        after_msg = time.monotonic() - t0
        took = time.monotonic() - ffn.started_at
        assert ffn.proc.returncode != 0
        text = ffn.log_path.read_text(errors="replace")
        assert "listening on" not in text
        line = next(ln for ln in text.splitlines() if want in ln)
        print(f"AFD port in use: exit rc={ffn.proc.returncode} {after_msg:.1f} s after the error, "
              f"{took:.0f} s after the start; {line.strip()[-260:]}")  # fmt: skip
        FIGURES["startup: port in use"] = (
            f"rc={ffn.proc.returncode} {after_msg:.1f} s after the error ({took:.0f} s after start)"
        )
        FIGURES["startup: unreachable host"] = (
            f"rc={attn.proc.returncode} {gave_up:.1f} s after connecting began"
        )
    finally:
        su.stop_servers(servers)
        blocker.close()
    for s in servers:
        assert s.gone(), su.group_members(s.pgid)
    assert all(su.port_bindable(p) for p in (api_ffn, api_attn, busy_port))


def _start_harness_ffn(model_dir: Path, port: int, log: Path, secret: str | None):
    cfg = su.afd_config("ffn", port=port, timeout_s=120)
    return harness_proc("ffn", model_dir, log, ["--afd", json.dumps(cfg)], secret)


def test_forged_attention_hello_does_not_end_an_ffn(model_dir, log_dir):
    """A well-formed hello that claims to be an attention rank with another fingerprint is
    refused and logged, and the FFN keeps waiting for its real peer (a hello proves nothing:
    without a shared secret anyone who reaches the port can send one). With a secret, a
    stranger's hello is refused before its fingerprint is looked at."""
    open_port, guarded_port = su.free_ports(2)
    secret = os.urandom(16).hex()
    logs = {
        "open": log_dir / "harness_ffn_open.log",
        "guarded": log_dir / "harness_ffn_guarded.log",
    }
    procs = {
        "open": _start_harness_ffn(model_dir, open_port, logs["open"], None),
        "guarded": _start_harness_ffn(model_dir, guarded_port, logs["guarded"], secret),
    }
    try:
        for name, proc in procs.items():
            ready = su.wait_for_log(logs[name], "AFD-FFN-READY", START_TIMEOUT_S, proc=proc)
            assert ready is not None, su.log_tail(logs[name])

        fps = {port: probe_fingerprint(port) for port in (open_port, guarded_port)}

        def forged(port: int, auth_secret: str | None) -> tuple[dict | None, int]:
            fp = fps[port]
            payload = {**fp, "role": "attention", "rank": 0, "num_hidden_layers": 99}
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                local_port = s.getsockname()[1]
                return attention_handshake(s, payload, auth_secret), local_port

        # no secret: the forged hello is refused with the mismatch, the FFN stays up
        reply, local_port = forged(open_port, None)
        assert (
            reply is not None and "fingerprint mismatch on 'num_hidden_layers'" in reply["status"]
        )
        seen = su.wait_for_log(logs["open"], f"(peer 127.0.0.1:{local_port})", 10)
        assert seen is not None, su.log_tail(logs["open"])
        assert "AFD: refused attention hello: AFD fingerprint mismatch on 'num_hidden_layers'" in (
            logs["open"].read_text()
        )
        assert su.wait_for_exit(procs["open"], 3) is None, "FFN ended on a forged hello"
        # ... and still answers handshakes (the probe is a well-formed non-attention hello)
        assert probe_fingerprint(open_port) == fps[open_port]

        # secret: the stranger (wrong secret, then none) is refused before the fingerprint
        for wrong in ("not-the-secret", None):
            reply, _ = forged(guarded_port, wrong)
            assert reply is not None and reply["status"].startswith("authentication failed")
        # a holder of the secret gets the fingerprint check, and is refused the same way
        reply, local_port = forged(guarded_port, secret)
        assert reply is not None and "fingerprint mismatch" in reply["status"], reply
        assert su.wait_for_log(logs["guarded"], f"(peer 127.0.0.1:{local_port})", 10) is not None
        assert su.wait_for_exit(procs["guarded"], 3) is None, "FFN ended on a forged hello"
        text = logs["guarded"].read_text()
        assert text.count("bad shared secret") == 3, text[-3000:]  # the probe + 2 forged
        for name in procs:
            assert "AFD-FFN-FAILED" not in logs[name].read_text()
        FIGURES["forged hello, no secret"] = "refused, FFN keeps serving"
        FIGURES["forged hello, secret set"] = "refused before the fingerprint check"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    for proc in procs.values():
        assert not su.group_members(proc.pid)
    assert su.port_bindable(open_port) and su.port_bindable(guarded_port)
