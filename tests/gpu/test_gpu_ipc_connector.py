"""The cuda_ipc connector on its own: two processes on one GPU.

Eager steps and CUDA-graph replays of a three-layer exchange return exactly
what the FFN process computed; a stalled FFN process and a killed one both
end in the attention side's failure callback within a bounded time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import serve_util as su  # noqa: E402

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HIDDEN = 256
LAYERS = 3
MAX_TOKENS = 128
TIMEOUT_S = 3.0


def _free_port() -> int:
    return su.free_port()


def _ctx(role: str, port: int):
    from vllm.afd.protocol import FINGERPRINT_KEYS, PROTOCOL_VERSION
    from vllm.config.afd import AFDConfig
    from vllm.distributed.afd.base import ConnectorContext

    cfg = AFDConfig.from_dict(
        {"role": role, "connector": "cuda_ipc", "port": port, "timeout_s": TIMEOUT_S}
    )
    fp = {k: "x" for k in FINGERPRINT_KEYS}
    fp.update(protocol=PROTOCOL_VERSION, hidden_size=HIDDEN, dtype="bfloat16",
              ffn_layers=list(range(LAYERS)), connector="cuda_ipc",
              num_attention_ranks=1, num_ffn_ranks=1, compute_gate_on_attention=False,
              max_num_tokens=MAX_TOKENS, afd_revision="test")  # fmt: skip
    return ConnectorContext(cfg, 0, fp, MAX_TOKENS, torch.device("cuda:0"))


def _ffn_main(port: int, stall_after: int, ready) -> None:
    from vllm.distributed.afd.base import create_ffn_connector

    torch.cuda.set_device(0)
    conn = create_ffn_connector(_ctx("ffn", port))
    conn.start()
    ready.set()
    served = 0
    while True:
        steps = conn.wait_step(timeout=0.2)
        for peer in steps:
            if served >= stall_after:
                time.sleep(3600)  # alive, never answers
            n = peer.control.num_tokens
            x = torch.empty((n, HIDDEN), dtype=torch.bfloat16, device="cuda")
            for layer in range(LAYERS):
                conn.recv(peer, x)
                conn.send(peer, x * 2 + layer)
            served += 1


def _reference(x: torch.Tensor) -> torch.Tensor:
    for layer in range(LAYERS):
        x = x * 2 + layer
    return x


class _Pair:
    def __init__(self, stall_after: int = 1 << 30):
        from vllm.distributed.afd.base import create_attention_connector

        # Everything slow first (imports, CUDA start): the FFN process waits
        # only timeout_s for this side.
        torch.zeros(1, device="cuda")
        port = _free_port()
        self.conn = create_attention_connector(_ctx("attention", port))
        self.failures: list[tuple[float, str]] = []
        self.conn.on_failure = lambda msg: self.failures.append((time.monotonic(), msg))
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self.ffn = ctx.Process(target=_ffn_main, args=(port, stall_after, ready), daemon=True)
        self.ffn.start()
        assert ready.wait(120), "FFN process did not start"
        self.conn.connect()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.conn.begin_step(0, x.shape[0])
        h = x
        for _ in range(LAYERS):
            self.conn.send(h)
            h = self.conn.recv(torch.empty_like(h))
        return h

    def wait_failure(self, bound: float) -> str:
        t0 = time.monotonic()
        while not self.failures and time.monotonic() - t0 < bound:
            time.sleep(0.05)
        assert self.failures, f"no failure reported within {bound} s"
        return self.failures[0][1]

    def close(self) -> None:
        self.conn._closed.set()
        if self.ffn.is_alive():
            os.kill(self.ffn.pid, signal.SIGKILL)
        self.ffn.join(10)


@pytest.fixture
def pair():
    made: list[_Pair] = []

    def make(**kw) -> _Pair:
        made.append(_Pair(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_eager_and_graph_replay_exact(pair):
    p = pair()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 7, 64, MAX_TOKENS):  # eager, several sizes
        x = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        assert torch.equal(p.step(x), _reference(x)), n
    for n in (4, 33):
        static = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        p.step(static)  # warm-up of this size
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = p.step(static)
        for _ in range(20):
            x = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, _reference(x)), n
        # Eager steps still interleave with replays (device counters agree).
        x = torch.randn((n, HIDDEN), dtype=torch.bfloat16, device="cuda", generator=gen)
        assert torch.equal(p.step(x), _reference(x))
    torch.cuda.synchronize()
    assert not p.failures


def test_stalled_ffn_fails_within_timeout(pair):
    p = pair(stall_after=2)
    x = torch.ones((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        assert torch.equal(p.step(x), _reference(x))
    t0 = time.monotonic()
    p.step(x)  # never answered: the device wait gives up after timeout_s
    msg = p.wait_failure(TIMEOUT_S + 5)
    elapsed = p.failures[0][0] - t0
    assert "did not answer within the timeout" in msg, msg
    assert TIMEOUT_S - 0.5 <= elapsed <= TIMEOUT_S + 2, elapsed
    torch.cuda.synchronize()  # the stream is not stuck
    print(f"stalled FFN: failure reported {elapsed:.2f} s after the step (timeout_s {TIMEOUT_S})")


def test_killed_ffn_fails_fast(pair):
    p = pair()
    x = torch.ones((8, HIDDEN), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(p.step(x), _reference(x))
    t0 = time.monotonic()
    os.kill(p.ffn.pid, signal.SIGKILL)
    msg = p.wait_failure(5)
    elapsed = p.failures[0][0] - t0
    assert "lost AFD peer" in msg, msg
    assert elapsed < 2, elapsed
    print(f"killed FFN: failure reported {elapsed:.2f} s after SIGKILL")
