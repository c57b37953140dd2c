"""Helpers of the TCP connector tests (tests/unit/connectors/test_tcp_connector.py,
test_tcp_hardening.py): connector contexts, a fixture that closes what a test
opened, waits with deadlines."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

from serve_util import free_port
from vllm.afd import protocol as P
from vllm.config.afd import AFDConfig
from vllm.distributed.afd import tcp
from vllm.distributed.afd.base import ConnectorContext

HOST = "127.0.0.1"
HIDDEN = 16
MAX_TOKENS = 64
TIMEOUT = 2.0


def fingerprint(**changes) -> dict:
    fp = {
        "protocol": P.PROTOCOL_VERSION,
        "architecture": "LlamaForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": HIDDEN,
        "ffn_layers": [0, 1],
        "ffn_blocks": "0-1:LlamaMLP",
        "num_experts": None,
        "mlp_config": "intermediate_size=32",
        "dtype": "float32",
        "num_attention_ranks": 1,
        "num_ffn_ranks": 1,
        "connector": "gloo",
        "compute_gate_on_attention": False,
        "max_num_tokens": MAX_TOKENS,
        "afd_revision": "unit-test",
        "checkpoint": "0123456789abcdef01234567 (config.json + 1 safetensors file)",
    }
    assert set(fp) == set(P.FINGERPRINT_KEYS)
    fp.update(changes)
    return fp


def make_ctx(
    role, port, rank=0, m=1, n=1, timeout=TIMEOUT, extra=None, host=HOST, addresses=None,
    connector="tcp", **fp_changes,
):
    cfg = AFDConfig.from_dict(
        {
            "role": role,
            "connector": connector,
            "host": host,
            "port": port,
            "ffn_addresses": addresses,
            "num_attention_ranks": m,
            "num_ffn_ranks": n,
            "timeout_s": timeout,
            "connector_extra_config": extra or {},
        }
    )
    fp = fingerprint(num_attention_ranks=m, num_ffn_ranks=n, connector=cfg.connector)
    fp.update(fp_changes)
    return ConnectorContext(
        config=cfg,
        rank=rank,
        fingerprint=fp,
        max_num_tokens=MAX_TOKENS,
        device=torch.device("cpu"),
    )


class Bg(threading.Thread):
    """Run fn in a thread; get() returns its result or re-raises its exception."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.result = None
        self.exc: BaseException | None = None
        self.start()

    def run(self):
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:
            self.exc = e

    def get(self, timeout=10.0):
        self.join(timeout)
        assert not self.is_alive(), f"{self.fn} still running after {timeout} s"
        if self.exc is not None:
            raise self.exc
        return self.result


@pytest.fixture
def net():
    """Builds connectors and closes every one of them (and raw sockets) at the end."""

    class Net:
        def __init__(self):
            self.items = []

        def ffn(self, port, **kw):
            c = tcp.TCPFFNConnector(make_ctx("ffn", port, **kw))
            self.items.append(c)
            return c

        def attention(self, port, **kw):
            c = tcp.TCPAttentionConnector(make_ctx("attention", port, **kw))
            self.items.append(c)
            return c

        def raw(self, port):
            s = socket.create_connection((HOST, port), timeout=5)
            self.items.append(s)
            return s

    n = Net()
    yield n
    for item in reversed(n.items):
        if isinstance(item, tcp.TCPFFNConnector) and item.listener is not None:
            # let the accept thread get going first (see test_close_right_after_start)
            wait_until(lambda lst=item.listener: lst.gettimeout() == 0.5, 2.0)
        try:
            item.close()
        except Exception:
            pass


def connected_pair(net, port=None, **kw):
    port = port or free_port()
    ffn = net.ffn(port, **kw)
    ffn.start()
    att = net.attention(port, **kw)
    Bg(att.connect).get()
    wait_until(lambda: 0 in ffn.peers)
    return ffn, att


def wait_until(pred, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout} s")


def wait_peers(ffn, ranks, timeout=5.0):
    """wait_step until step peers of all `ranks` were seen (bounded)."""
    seen = {}
    deadline = time.monotonic() + timeout
    while set(seen) != set(ranks):
        assert time.monotonic() < deadline, f"saw step peers {sorted(seen)}, wanted {ranks}"
        for p in ffn.wait_step(0.1):
            seen[p.rank] = p
    return seen


def wait_lost(ffn, rank: int, timeout: float = 3.0) -> str:
    """Serve as the FFN runner does (wait_step; a later micro-batch's control read,
    the rank dropped when that fails) until the FFN rank has dropped attention rank
    ``rank``; why it did. A lost rank never raises out of wait_step: the others are
    served on."""
    deadline = time.monotonic() + timeout
    while rank in ffn.peers:
        assert time.monotonic() < deadline, f"attention rank {rank} not dropped in {timeout} s"
        for p in ffn.wait_step(0.1):
            if P.ubatch_of(p.control.flags)[1]:
                try:
                    ffn.recv_control(p)
                except P.AFDPeerError as e:
                    ffn.drop_peer(p, str(e))
    assert rank in ffn.lost, f"attention rank {rank} left without a loss (a goodbye?)"
    return ffn.lost[rank]


def step_to_ffn(ffn, att, step_id: int, n: int):
    """Attention begins a step and sends one layer of n random rows; the FFN receives it.
    Returns (step peer, the rows sent, the rows received)."""
    att.begin_step(step_id, n)
    (peer,) = wait_peers(ffn, [att.ctx.rank]).values()
    x = torch.randn(n, HIDDEN)
    att.send(x)
    buf = torch.empty(n, HIDDEN)
    ffn.recv(peer, buf)
    return peer, x, buf


def serve_one_step(ffn, att, step_id: int, n: int = 2) -> None:
    """One single-layer step of ``att``, answered by the FFN rank with x + 1."""
    peer, x, buf = step_to_ffn(ffn, att, step_id, n)
    ffn.send(peer, buf + 1)
    assert torch.equal(att.recv(torch.empty(n, HIDDEN)), x + 1)
    att.end_step()


def assert_dropped(sock: socket.socket, timeout: float = 5.0) -> None:
    """The FFN closed this stranger's connection without answering (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(100)
    except ConnectionResetError:
        return
    assert data == b""


def kill(sock: socket.socket, rst: bool) -> None:
    if rst:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
