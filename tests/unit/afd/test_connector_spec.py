"""The connector spec records drive configuration validation (vllm.afd.connector_spec) and
the FFN ranks' addresses (ffn_addresses) parse, check and resolve as documented."""

from __future__ import annotations

import math

import pytest

from vllm.afd import connector_spec
from vllm.afd.connector_spec import SPECS
from vllm.config.afd import AFDConfig, AFDConfigError, join_address, split_address


def _cfg(**kw) -> AFDConfig:
    return AFDConfig.from_dict({"role": "attention", **kw})


@pytest.mark.parametrize(
    "connector, extra, message",
    [
        # an unknown key (a typo) is refused, naming the allowed ones
        ("cuda_ipc", {"ipc_rejoin_typo": True},
         r"unknown key\(s\) 'ipc_rejoin_typo' for connector 'cuda_ipc'; allowed: .*ipc_rejoin"),
        # a key of another connector is unknown here
        ("gloo", {"ipc_rejoin": True}, r"unknown key\(s\) 'ipc_rejoin' for connector 'gloo'"),
        ("cuda_ipc", {"ffn_failover": True}, r"unknown key\(s\) 'ffn_failover'"),
        # wrong types
        ("gloo", {"ffn_failover": "yes"}, r"ffn_failover must be true or false; got 'yes'"),
        ("gloo", {"batch_window_ms": "5"}, r"batch_window_ms must be a number in 0\.\.10000"),
        ("gloo", {"ffn_cuda_graph_max_count": 1.0}, r"max_count must be an integer in 0\.\.4096"),
        # out of range, infinite, not a number
        ("gloo", {"batch_window_ms": math.inf}, r"batch_window_ms must be a number .*; got inf"),
        ("gloo", {"batch_window_ms": math.nan}, r"batch_window_ms must be a number .*; got nan"),
        ("gloo", {"batch_window_ms": -1}, r"batch_window_ms must be a number in 0\.\.10000; got -1"),
        ("gloo", {"ffn_cuda_graph_max_count": 5000}, r"in 0\.\.4096; got 5000"),
        ("gloo", {"secret_env": ""}, r"secret_env must be a non-empty string"),
        # a string key of fixed choices takes those only
        ("cuda_ipc", {"ffn_schedule": "ping-pong"},
         r"ffn_schedule must be one of 'join', 'pingpong', 'auto'; got 'ping-pong'"),
        ("gloo", {"ffn_schedule": ""}, r"ffn_schedule must be one of 'join', 'pingpong', 'auto'; got ''"),
        ("nixl", {"ffn_schedule": True}, r"ffn_schedule must be one of .*; got True"),
    ],
)
def test_spec_records_drive_validation(connector, extra, message):
    with pytest.raises(AFDConfigError, match=r"^--afd-config: connector_extra_config.*" + message):
        _cfg(connector=connector, connector_extra_config=extra)


def test_the_keys_a_record_declares_are_accepted_with_their_defaults():
    c = _cfg(connector="ipc", connector_extra_config={"ipc_rejoin": True, "batch_window_ms": 0})
    assert c.connector == "cuda_ipc" and c.spec is SPECS["cuda_ipc"]
    assert c.spec.value(c.connector_extra_config, "ipc_rejoin") is True
    assert c.spec.value(c.connector_extra_config, "ffn_hot_poll") is True  # the default
    for spec in connector_spec.all_specs():
        for schedule in ("join", "pingpong", "auto"):  # a key of the channel: every connector takes it
            c = _cfg(connector=spec.name, connector_extra_config={"ffn_schedule": schedule})
            assert c.spec.value(c.connector_extra_config, "ffn_schedule") == schedule
        for key in spec.keys().values():  # every default passes its own check
            assert key.default is None or key.check(key.default) is None, (spec.name, key)


def test_capabilities_come_from_the_record(monkeypatch):
    import dataclasses

    # failover: declared by gloo (and nixl)
    _cfg(connector="gloo", num_ffn_ranks=2, num_attention_ranks=2,
         connector_extra_config={"ffn_failover": True})
    # nccl serves several FFN ranks (a communicator per session; before: N = 1)
    for name in ("nccl", "P2pNcclAFDConnector"):
        assert _cfg(connector=name, num_ffn_ranks=2, num_attention_ranks=4).num_ffn_ranks == 2
    # a record's limit of FFN ranks is what refuses more
    monkeypatch.setitem(SPECS, "nccl", dataclasses.replace(SPECS["nccl"], max_ffn_ranks=1))
    with pytest.raises(AFDConfigError, match=r"connector 'nccl' serves num_ffn_ranks <= 1"):
        _cfg(connector="nccl", num_ffn_ranks=2, num_attention_ranks=2)
    assert SPECS["cuda_ipc"].graph_capable and not SPECS["gloo"].graph_capable
    assert SPECS["gloo"].dbo_devices == ("cpu",) and SPECS["cuda_ipc"].dbo_devices == ("cuda",)


def test_names_and_aliases_are_unique_and_case_blind():
    assert connector_spec.resolve("TCP") is SPECS["gloo"]
    assert connector_spec.resolve("P2pNcclAFDConnector") is SPECS["nccl"]
    with pytest.raises(ValueError, match="is taken by 'gloo'"):
        connector_spec.register(connector_spec.ConnectorSpec(
            name="other", aliases=("tcp",), module="m", attention_class="A", ffn_class="F",
            summary="", devices=("cpu",), cross_host=True))


# ------------------------------------------------------------------ ffn_addresses
@pytest.mark.parametrize(
    "text, where",
    [
        ("ffn-0.ffn.default.svc:29600", ("ffn-0.ffn.default.svc", 29600)),
        ("127.0.0.2:1", ("127.0.0.2", 1)),
        ("[::1]:65535", ("::1", 65535)),
        (" host:80 ", ("host", 80)),
    ],
)
def test_addresses_split_and_join(text, where):
    assert split_address(text) == where
    assert split_address(join_address(*where)) == where


@pytest.mark.parametrize(
    "text, message",
    [
        ("host", "has no port"),
        ("host:", "the port must be an integer in 1..65535"),
        ("host:0", "the port must be an integer in 1..65535"),
        ("host:65536", "the port must be an integer in 1..65535"),
        ("host:8o", "the port must be an integer"),
        (":80", "has no valid host"),
        ("::1:80", "IPv6 address as"),
        ("[::1]80", "IPv6 address as"),
        ("a b:80", "has no valid host"),
    ],
)
def test_bad_addresses_are_refused(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        split_address(text)
    with pytest.raises(AFDConfigError, match=r"'ffn_addresses'\[0\]: .*" + message[:12]):
        _cfg(ffn_addresses=[text])


def test_ffn_addresses_one_per_rank_each_its_own():
    c = _cfg(num_attention_ranks=4, num_ffn_ranks=2,
             ffn_addresses=["ffn-0.ffn:29600", "ffn-1.ffn:29600"])
    assert c.ffn_address(1) == ("ffn-1.ffn", 29600)
    assert c.ffn_address_text(0) == "ffn-0.ffn:29600"
    ffn = AFDConfig.from_dict({"role": "ffn", "host": "0.0.0.0", "rank": 1, "num_ffn_ranks": 2,
                               "num_attention_ranks": 2,
                               "ffn_addresses": ["a:7000", "b:7100"]})
    assert ffn.ffn_listen_address(1) == ("0.0.0.0", 7100)
    # without ffn_addresses: host:port+f as before
    plain = _cfg(num_attention_ranks=2, num_ffn_ranks=2, port=30000)
    assert plain.ffn_address(1) == ("127.0.0.1", 30001)
    with pytest.raises(AFDConfigError, match=r"'ffn_addresses' has 1 entry; it needs one per "
                                             r"FFN rank \(num_ffn_ranks 2\)"):
        _cfg(num_attention_ranks=2, num_ffn_ranks=2, ffn_addresses=["a:1"])
    with pytest.raises(AFDConfigError, match=r"'ffn_addresses'\[1\] 'a:1' is also FFN rank 0's"):
        _cfg(num_attention_ranks=2, num_ffn_ranks=2, ffn_addresses=["a:1", "a:1"])
    with pytest.raises(AFDConfigError, match=r"'ffn_addresses' must be a list of"):
        _cfg(ffn_addresses="a:1")
