"""nccl connector (vllm.distributed.afd.nccl) without NCCL: the TCP handshake over
real sockets on 127.0.0.1, the communicator replaced by a recording fake.

An nccl FFN rank that has formed its NCCL group must refuse an
attention rank that joins again, in the handshake reply, instead of accepting it
(its NCCL setup would then wait for a group that is gone, and the FFN's receives
from it would hang the other ranks)."""

from __future__ import annotations

import pytest
import torch
from tcp_lib import HOST, MAX_TOKENS, Bg, fingerprint, wait_until

from serve_util import free_port
from vllm.afd.protocol import MSG_STEP, AFDHandshakeError
from vllm.config.afd import AFDConfig
from vllm.distributed.afd import nccl
from vllm.distributed.afd.base import ConnectorContext


def _ctx(role: str, port: int, rank: int = 0, m: int = 2) -> ConnectorContext:
    cfg = AFDConfig.from_dict({
        "role": role, "connector": "nccl", "host": HOST, "port": port,
        "num_attention_ranks": m, "num_ffn_ranks": 1, "timeout_s": 3.0,
    })  # fmt: skip
    fp = fingerprint(num_attention_ranks=m, connector="nccl")
    return ConnectorContext(cfg, rank, fp, MAX_TOKENS, torch.device("cpu"))


class _FakeComm:
    disabled = False

    def __init__(self, ffn_rank: int, member: int):
        self.ffn_rank, self.member = ffn_rank, member


@pytest.fixture
def group(monkeypatch):
    """An nccl FFN rank serving attention ranks 0 and 1, both connected and the
    (fake) NCCL group formed; everything opened is closed at the end."""
    made: list = []
    comms: list[_FakeComm] = []

    def create_comm(ctx, ffn_rank, member):
        comms.append(_FakeComm(ffn_rank, member))
        return comms[-1]

    monkeypatch.setattr(nccl, "_create_comm", create_comm)

    def attention(port: int, rank: int) -> nccl.NCCLAttentionConnector:
        made.append(nccl.NCCLAttentionConnector(_ctx("attention", port, rank)))
        return made[-1]

    port = free_port()
    ffn = nccl.NCCLFFNConnector(_ctx("ffn", port))
    made.append(ffn)
    ffn.start()
    joins = [Bg(attention(port, r).connect) for r in (0, 1)]
    wait_until(lambda: set(ffn.peers) == {0, 1}, what="both attention ranks accepted")
    for j in joins:
        j.get()
    ffn.wait_step(0.01)  # forms the NCCL group: every rank has joined
    assert ffn.comm is not None and sorted(c.member for c in comms) == [0, 1, 2]
    yield port, ffn, made[1:3], attention
    for c in reversed(made):
        c.close()


def test_a_rank_joining_again_is_refused_in_the_reply_and_the_others_go_on(group):
    port, ffn, (att0, att1), attention = group
    att1.close()  # goodbye: its server stopped
    wait_until(lambda: ffn.wait_step(0.01) == [] and 1 not in ffn.peers,
               what="the FFN rank dropped attention rank 1")  # fmt: skip
    again = attention(port, 1)
    with pytest.raises(AFDHandshakeError) as e:
        Bg(again.connect).get()
    msg = str(e.value)
    assert "refused this attention rank" in msg and "formed its NCCL group" in msg
    assert "cannot take attention rank 1 again" in msg and "restart the FFN server" in msg
    assert again.sock is None and set(ffn.peers) == {0}
    # Attention rank 0 is still served.
    att0.begin_step(7, 3)
    seen = []
    wait_until(lambda: bool(seen.extend(ffn.wait_step(0.05)) or seen), what="rank 0's step")
    assert [(s.rank, s.control.type, s.control.step_id) for s in seen] == [(0, MSG_STEP, 7)]
    assert att0.is_up()
