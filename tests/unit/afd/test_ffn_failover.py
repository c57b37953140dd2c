"""FFN replicas failover, the FFN side: an FFN rank with
connector_extra_config.ffn_failover takes an attention rank of another replica as a guest
when its hello says it fails over here (its home FFN rank is away). Over real sockets on
127.0.0.1 (the TCP connector, tcp_lib's fakes): the guest is served like an own rank (its
step may join a pass of an own rank), is not waited for at start and not listed among the
own ranks, and is dropped like any rank when it leaves. Refused: a guest of another
deployment, a guest at an FFN rank without ffn_failover, a rank that does not say it fails
over. And the config errors of the key."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import tcp_lib
from tcp_lib import Bg, kill, serve_one_step, wait_lost, wait_peers, wait_until

from serve_util import free_ports
from vllm.afd.protocol import AFDHandshakeError, AFDPeerError
from vllm.config.afd import AFDConfig, AFDConfigError

net = tcp_lib.net  # the fixture

FAILOVER = {"ffn_failover": True}
TOPO = dict(m=2, n=2)  # two replicas, one attention rank each


def replica(net, port: int, rank: int, extra=FAILOVER, timeout: float = 5.0):
    ffn = net.ffn(port, rank=rank, extra=extra, timeout=timeout, **TOPO)
    ffn.start()
    return ffn


def rank_at(net, port: int, rank: int, ffn_rank: int, extra=FAILOVER, **kw):
    """Attention rank ``rank`` dialing FFN rank ``ffn_rank`` (another replica than its
    home: failing over, as _establish_any does)."""
    att = net.attention(port, rank=rank, extra=extra, **TOPO, **kw)
    att._heartbeat_loop = lambda: None  # no rebalancing home meanwhile: the test drives
    att._aim(ffn_rank)
    return att


def replica_with_guest(net):
    """FFN rank 1 (failover on) with its own attention rank 1 and attention rank 0 as a
    guest, both connected and accepted: (port, the FFN rank, own rank, guest rank)."""
    port = free_ports(2, consecutive=True)[0]
    ffn1 = replica(net, port, 1)
    own, guest = rank_at(net, port, 1, 1), rank_at(net, port, 0, 1)
    Bg(own.connect).get()
    Bg(guest.connect).get()
    wait_until(lambda: set(ffn1.peers) == {0, 1}, what="both ranks accepted")
    assert ffn1.guest_ranks() == [0]
    return port, ffn1, own, guest


def test_a_failing_over_rank_is_served_as_a_guest(net):
    _, ffn1, own, guest = replica_with_guest(net)
    assert ffn1.peer_states() == {"attention_rank_1": True}  # own ranks only
    serve_one_step(ffn1, guest, 1)
    serve_one_step(ffn1, own, 1)
    # the guest's step joins the own rank's pass: both are ready together
    guest.begin_step(2, 3)
    own.begin_step(2, 4)
    seen = wait_peers(ffn1, [0, 1])
    assert {r: p.control.num_tokens for r, p in seen.items()} == {0: 3, 1: 4}


def test_a_guest_is_not_waited_for_at_start(net):
    """An FFN rank whose own rank never comes ends at start after timeout_s, a guest
    notwithstanding; with its own rank there it serves on past timeout_s."""
    port = free_ports(2, consecutive=True)[0]
    ffn1 = replica(net, port, 1, timeout=1.0)
    guest = rank_at(net, port, 0, 1, timeout=1.0)
    Bg(guest.connect).get()
    wait_until(lambda: 0 in ffn1.peers, what="the guest accepted")
    time.sleep(1.1)
    with pytest.raises(AFDPeerError, match=r"attention rank\(s\) \[1\] did not connect"):
        ffn1.wait_step(0.01)
    port = free_ports(2, consecutive=True)[0]
    ffn2 = replica(net, port, 0, timeout=1.0)
    guest2 = rank_at(net, port, 1, 0, timeout=1.0)  # rank 1 a guest at FFN rank 0
    own = rank_at(net, port, 0, 0, timeout=1.0)
    Bg(guest2.connect).get()
    Bg(own.connect).get()
    wait_until(lambda: set(ffn2.peers) == {0, 1}, what="both ranks accepted")
    time.sleep(1.1)
    assert ffn2.wait_step(0.01) == []  # complete: its own rank came


@pytest.mark.parametrize("how", ["goodbye", "reset"])
def test_a_guest_that_leaves_is_dropped_and_may_come_again(net, how):
    port, ffn1, own, guest = replica_with_guest(net)
    if how == "goodbye":  # it moves back home
        guest.close()
        deadline = time.monotonic() + 3.0
        while 0 in ffn1.peers:
            assert time.monotonic() < deadline, "the guest's goodbye not seen"
            ffn1.wait_step(0.05)
    else:
        kill(guest.sock, rst=True)
        wait_lost(ffn1, 0)
    assert ffn1.guest_ranks() == [] and 0 not in ffn1.peers
    serve_one_step(ffn1, own, 1)
    again = rank_at(net, port, 0, 1)
    Bg(again.connect).get()
    wait_until(lambda: ffn1.guest_ranks() == [0], what="the guest taken again")
    serve_one_step(ffn1, again, 1)


def refusal(net, ffn_extra, att_extra, aim_home: bool = False, **fp) -> str:
    port = free_ports(2, consecutive=True)[0]
    replica(net, port, 1, extra=ffn_extra)
    att = net.attention(port, rank=0, extra=att_extra, **TOPO, **fp)
    att._heartbeat_loop = lambda: None
    if not aim_home:
        att._aim(1)
    else:  # a rank that dials FFN rank 1 as if it were its own (no failover in its hello)
        att.home = 1
        att._aim(1)
    with pytest.raises(AFDHandshakeError) as e:
        Bg(att.connect).get()
    return str(e.value)


def test_an_ffn_rank_without_ffn_failover_refuses_guests(net):
    msg = refusal(net, {}, FAILOVER)
    assert "attention rank 0 is not served by FFN rank 1 (it serves [1])" in msg
    assert "does not take guests: set connector_extra_config.ffn_failover true" in msg


def test_a_rank_that_does_not_fail_over_is_refused(net):
    msg = refusal(net, FAILOVER, {}, aim_home=True)
    assert msg.endswith("refused this attention rank: attention rank 0 is not served by "
                        "FFN rank 1 (it serves [1])")  # fmt: skip


@pytest.mark.parametrize("field", ["checkpoint", "afd_revision"])
def test_a_guest_of_another_deployment_is_refused(net, field):
    msg = refusal(net, FAILOVER, FAILOVER, **{field: "another"})
    assert f"AFD fingerprint mismatch on '{field}'" in msg


def test_a_guest_of_another_topology_is_refused(net):
    """num_attention_ranks differs: the fingerprint names it before any guest check."""
    port = free_ports(2, consecutive=True)[0]
    replica(net, port, 1)
    att = net.attention(port, rank=0, extra=FAILOVER, m=4, n=2)
    att._aim(1)
    with pytest.raises(AFDHandshakeError, match="mismatch on 'num_attention_ranks'"):
        Bg(att.connect).get()


# ---------------------------------------------------------------------------- config
def test_ffn_failover_is_off_by_default_and_on_for_replicas():
    base = {"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2}
    assert AFDConfig.from_dict(base).ffn_failover is False
    on = AFDConfig.from_dict({**base, "connector_extra_config": FAILOVER})
    assert on.ffn_failover is True


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"num_ffn_ranks": 1},
            r"ffn_failover needs FFN replicas to fail over to "
            r"\(num_ffn_ranks > 1.*got num_ffn_ranks 1",
        ),
        ({"connector": "nccl", "num_ffn_ranks": 1},
         r"unknown key\(s\) 'ffn_failover' for connector 'nccl'"),
        (
            {"connector": "cuda_ipc"},
            r"unknown key\(s\) 'ffn_failover' for connector 'cuda_ipc'",
        ),
    ],
)
def test_ffn_failover_config_errors(raw, message):
    full = {"role": "attention", "num_attention_ranks": 2, "num_ffn_ranks": 2,
            "connector_extra_config": FAILOVER, **raw}  # fmt: skip
    with pytest.raises(AFDConfigError, match=message):
        AFDConfig.from_dict(full)


def test_ffn_failover_is_refused_for_an_ffn_group():
    cfg = AFDConfig.from_dict({"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2,
                               "connector_extra_config": FAILOVER})  # fmt: skip
    parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                               data_parallel_size=1, enable_expert_parallel=False)  # fmt: skip
    vllm = SimpleNamespace(parallel_config=parallel, speculative_config=None,
                           device_config=SimpleNamespace(device_type="cpu"))  # fmt: skip
    with pytest.raises(
        AFDConfigError,
        match=r"ffn_failover needs FFN replicas.*FFN group "
        r"\(tensor_parallel_size=2\) whose ranks split",
    ):
        cfg.verify_with_vllm_config(vllm)
