"""The connectors' shared layer: framed socket primitives (vllm.distributed.afd.channel),
the FFN side's step-id check, the base classes' contract and the lazy connector registry
(vllm.distributed.afd.base)."""

from __future__ import annotations

import ast
import os
import resource
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm.afd import protocol as P
from vllm.config.afd import AFDConfig
from vllm.distributed.afd import base, channel

AFD_PACKAGE = Path(__file__).resolve().parents[3] / "overlay" / "vllm" / "distributed" / "afd"


def high_descriptors(at_least: int = 1024) -> list[int]:
    """Open /dev/null until the next descriptor is >= at_least (raising the soft file
    limit when needed); the caller closes the returned descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < at_least + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, at_least + 256), hard))
    fds = []
    try:
        while not fds or fds[-1] < at_least:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


# ---------------------------------------------------------------- readiness
def test_readable_works_with_descriptors_above_1024():
    """select() raises ValueError for a descriptor >= 1024; poll does not."""
    fillers = high_descriptors()
    try:
        a, b = socket.socketpair()
        with a, b:
            assert a.fileno() >= 1024
            assert channel.readable([a], 0) == []
            b.sendall(b"x")
            assert channel.readable([a], 2.0) == [a]
    finally:
        for fd in fillers:
            os.close(fd)


def test_readable_reports_eof_and_skips_closed_sockets():
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with a, d:
        b.close()  # EOF on a
        c.close()  # c: descriptor -1 now
        t0 = time.monotonic()
        assert channel.readable([a, c], 2.0) == [a]
        assert time.monotonic() - t0 < 1.0
        assert a.recv(1) == b""


def test_readable_waits_for_its_timeout():
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        assert channel.readable([a], 0.2) == []
        assert time.monotonic() - t0 >= 0.15


# -------------------------------------------------------------- framed bytes
def test_hello_round_trip_and_deadline():
    a, b = socket.socketpair()
    with a, b:
        channel.send_hello(a, {"role": "x", "rank": 1}, 1.0, "peer")
        assert channel.recv_hello(b, time.monotonic() + 1.0, "peer") == {"role": "x", "rank": 1}
        t0 = time.monotonic()
        with pytest.raises(P.AFDPeerError, match="AFD peer peer did not answer within"):
            channel.recv_hello(b, time.monotonic() + 0.2, "peer")
        assert time.monotonic() - t0 < 1.0
        a.close()
        with pytest.raises(P.AFDPeerError, match="lost AFD peer peer: connection closed"):
            channel.recv_bytes(b, 1, time.monotonic() + 1.0, "peer")


def test_tensors_staged_through_host_when_not_contiguous():
    a, b = socket.socketpair()
    with a, b:
        y = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
        channel.send_tensor(a, y, 1.0, "peer")
        out = torch.zeros(3, 4).t()
        channel.recv_tensor(b, out, time.monotonic() + 1.0, "peer")
        assert torch.equal(out, y)


# ------------------------------------------------------------------ step ids
def step(step_id, ubatch=None, tokens=1):
    flags = P.ubatch_flags(*ubatch) if ubatch else 0
    return P.Control(P.MSG_STEP, step_id, tokens, flags)


def test_step_ids_grow_and_micro_batches_share_them():
    peer = channel.Peer(0, None, "x")
    for ctrl in (step(0), step(1), step(5, (0, 2)), step(5, (1, 2)), step(6, (0, 3)),
                 step(6, (1, 3)), step(6, (2, 3)), step(9), P.Control(P.MSG_HEARTBEAT)):  # fmt: skip
        peer.check_step(ctrl)
    assert (peer.last_step_id, peer.open_step) == (9, None)


@pytest.mark.parametrize(
    "controls, error",
    [
        ([step(3), step(3)], "step id 3 after step 3"),
        ([step(3), step(2)], "step id 2 after step 3"),
        ([step(4, (1, 2))], "step 4 opened with micro-batch 1 of 2"),
        ([step(4, (0, 2)), step(5, (1, 2))], "micro-batch 1 of 2 of step 4 was due"),
        ([step(4, (0, 2)), step(5)], "micro-batch 1 of 2 of step 4 was due"),
        ([step(4, (0, 2)), step(4, (0, 2))], "micro-batch 1 of 2 of step 4 was due"),
        ([step(4, (0, 3)), step(4, (1, 2))], "micro-batch 1 of 3 of step 4 was due"),
    ],
)
def test_step_out_of_order_is_a_protocol_error(controls, error):
    peer = channel.Peer(0, None, "x")
    for ctrl in controls[:-1]:
        peer.check_step(ctrl)
    with pytest.raises(P.AFDProtocolError, match=error):
        peer.check_step(controls[-1])


# ------------------------------------------------------- the base contract
def _ctx(connector="gloo", role="ffn"):
    cfg = AFDConfig.from_dict({"role": role, "connector": connector})
    return base.ConnectorContext(cfg, 0, {}, 8, torch.device("cpu"))


class _Minimal(base.AttentionConnector):
    def connect(self): ...
    def begin_step(self, step_id, num_tokens, ubatch=None, ubatch_tokens=None): ...
    def send(self, x): ...
    def recv(self, out): return out  # fmt: skip

    def end_step(self): ...
    def close(self): ...


class _MinimalFFN(base.FFNConnector):
    def start(self): ...
    def wait_step(self, timeout): return []  # fmt: skip

    def recv(self, peer, out): ...
    def send(self, peer, y): ...
    def close(self): ...


def test_base_classes_declare_the_whole_contract():
    """What the roles call on a connector (attention.py, dbo.py, ffn_runner.py) exists on
    the base classes, with a clear refusal where a connector lacks the feature."""
    att = _Minimal(_ctx(role="attention"))
    assert att.is_up() and not att.dbo_capable and not att.graph_capable
    with pytest.raises(NotImplementedError, match="'gloo' does not serve micro-batched"):
        att.recv_start(torch.empty(1))
    with pytest.raises(NotImplementedError, match="cannot drive the FFN profiler"):
        att.profile(True)
    ffn = _MinimalFFN(_ctx())
    assert ffn.take_profile_requests() == [] and ffn.peer_states() == {}
    assert ffn.generation == 0 and ffn.ubatch_controls_upfront is False
    with pytest.raises(NotImplementedError, match="'gloo' does not serve micro-batched"):
        ffn.recv_control(base.StepPeer(0, P.Control(P.MSG_STEP, 1, 1)))
    import inspect

    params = inspect.signature(base.AttentionConnector.begin_step).parameters
    assert list(params) == ["self", "step_id", "num_tokens", "ubatch", "ubatch_tokens"]


# -------------------------------------------------------------- registry
def test_a_connector_named_by_module_path_is_imported_and_read_from_its_spec(
    tmp_path, monkeypatch
):
    from vllm.afd import connector_spec
    from vllm.config.afd import AFDConfig, AFDConfigError

    (tmp_path / "afd_ext").mkdir()
    (tmp_path / "afd_ext" / "__init__.py").write_text("")
    mod = tmp_path / "afd_ext" / "lazy_connector.py"
    mod.write_text(
        "from vllm.afd.connector_spec import ConnectorSpec, ExtraKey, INT\n"
        "AFD_CONNECTOR_SPEC = ConnectorSpec(\n"
        "    name='lazy_test', module='afd_ext.lazy_connector', attention_class='A',\n"
        "    ffn_class='F', summary='a test plane', devices=('cpu',), cross_host=True,\n"
        "    extra_keys=(ExtraKey('lanes', INT, 1, 'lanes', minimum=1, maximum=8),))\n"
        "from vllm.distributed.afd.base import AttentionConnector, FFNConnector\n"
        "class A(AttentionConnector):\n"
        "    connect = begin_step = send = recv = end_step = close = lambda *a, **k: None\n"
        "class F(FFNConnector):\n"
        "    start = wait_step = recv = send = close = lambda *a, **k: None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(connector_spec, "SPECS", dict(connector_spec.SPECS))
    monkeypatch.setattr(base, "_LOADED", dict(base._LOADED))
    monkeypatch.delitem(sys.modules, "afd_ext.lazy_connector", raising=False)
    assert "lazy_test" not in base.connector_names()
    cfg = AFDConfig.from_dict(
        {"role": "attention", "connector": "afd_ext.lazy_connector",
         "connector_extra_config": {"lanes": 4}}
    )
    # configuration canonicalises the module path to the spec's name and registers it
    assert cfg.connector == "lazy_test" and "lazy_test" in base.connector_names()
    with pytest.raises(AFDConfigError, match=r"connector_extra_config.lanes must be an integer in 1\.\.8; got 9"):
        AFDConfig.from_dict({"role": "attention", "connector": "afd_ext.lazy_connector",
                             "connector_extra_config": {"lanes": 9}})
    ctx = _ctx()
    object.__setattr__(ctx.config, "connector", "lazy_test")
    att = base.create_connector(ctx, "attention")
    assert type(att).__name__ == "A"
    assert type(base.create_ffn_connector(ctx)).__name__ == "F"
    with pytest.raises(ValueError, match="role must be one of"):
        base.create_connector(ctx, "router")


def test_a_module_path_without_a_spec_is_refused(tmp_path, monkeypatch):
    from vllm.afd import connector_spec
    from vllm.config.afd import AFDConfig, AFDConfigError

    (tmp_path / "afd_ext2").mkdir()
    (tmp_path / "afd_ext2" / "__init__.py").write_text("")
    (tmp_path / "afd_ext2" / "no_spec.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(connector_spec, "SPECS", dict(connector_spec.SPECS))
    with pytest.raises(AFDConfigError, match="afd_ext2.no_spec' defines no AFD_CONNECTOR_SPEC"):
        AFDConfig.from_dict({"role": "ffn", "connector": "afd_ext2.no_spec"})
    with pytest.raises(AFDConfigError, match="'afd_missing.mod' cannot be imported"):
        AFDConfig.from_dict({"role": "ffn", "connector": "afd_missing.mod"})


def test_unknown_connector_names_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown connector 'nope'; known: .*gloo"):
        base.connector_classes("nope")


def test_builtin_connectors_load_lazily_by_module_path():
    assert {"gloo", "nccl", "cuda_ipc"} <= set(base.connector_names())
    from vllm.afd.connector_spec import SPECS

    assert SPECS["gloo"].module == "vllm.distributed.afd.tcp"
    att_cls, ffn_cls = base.connector_classes("gloo")
    assert (att_cls.__name__, ffn_cls.__name__) == ("TCPAttentionConnector", "TCPFFNConnector")


def test_connector_modules_import_no_private_names_of_each_other():
    """cuda_ipc.py imported tcp.py's _Peer, _recv_bytes, _send_all; the shared pieces are
    public names of channel.py now."""
    bad = []
    for path in sorted(AFD_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("vllm.afd", "vllm.distributed.afd", "vllm.config.afd")
            ):
                bad += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []
