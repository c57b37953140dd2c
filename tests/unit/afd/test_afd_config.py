"""AFDConfig (overlay/vllm/config/afd.py), imported standalone: no vLLM needed."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

AFD_PY = Path(__file__).resolve().parents[3] / "overlay" / "vllm" / "config" / "afd.py"


def _load():
    spec = importlib.util.spec_from_file_location("afd_config_under_test", AFD_PY)
    mod = importlib.util.module_from_spec(spec)
    # dataclasses resolves string annotations through sys.modules
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


afd = _load()
AFDConfig = afd.AFDConfig
AFDConfigError = afd.AFDConfigError


def cfg(**kw) -> AFDConfig:
    kw.setdefault("role", "attention")
    return AFDConfig.from_dict(kw)


# ------------------------------------------------------------------ valid
def test_defaults():
    c = AFDConfig.from_dict({"role": "ffn"})
    assert c.role == "ffn"
    assert c.connector == "gloo"
    assert c.host == "127.0.0.1"
    assert c.port == 29600
    assert (c.num_attention_ranks, c.num_ffn_ranks) == (1, 1)
    assert c.compute_gate_on_attention is False
    assert c.timeout_s == 60.0
    assert c.connector_extra_config == {}
    assert c.rank is None
    assert c.is_ffn and not c.is_attention
    assert c.resolved_rank() == 0
    assert c.resolved_rank(3) == 3
    assert cfg(role="attention", rank=0).resolved_rank(5) == 0
    assert set(c.to_dict()) == set(AFDConfig.keys())


def imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_module_needs_no_vllm():
    """No torch and no vLLM: the one vLLM-side import is the pure-Python family registry
    (vllm.afd.architectures, itself importing neither), inside the check of a real model
    configuration."""
    tree = ast.parse(AFD_PY.read_text())
    assert not [m for m in imported_modules(tree) if m.split(".")[0] in ("torch", "vllm")
                and m not in ("vllm.afd.architectures", "vllm.afd", "vllm.afd.connector_spec")]
    specs = AFD_PY.parents[1] / "afd" / "connector_spec.py"
    assert not [m for m in imported_modules(ast.parse(specs.read_text()))
                if m.split(".")[0] in ("torch", "vllm")]
    top = [m for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
           for m in imported_modules(n)]
    assert "vllm.afd.architectures" not in top
    registry = AFD_PY.parents[1] / "afd" / "architectures.py"
    assert not [m for m in imported_modules(ast.parse(registry.read_text()))
                if m.split(".")[0] in ("torch", "vllm")]


@pytest.mark.parametrize(
    "given, canonical",
    [
        ("gloo", "gloo"),
        ("tcp", "gloo"),
        ("TCP", "gloo"),
        ("Gloo", "gloo"),
        ("nccl", "nccl"),
        ("NCCL", "nccl"),
        ("P2pNcclAFDConnector", "nccl"),
        ("p2pncclafdconnector", "nccl"),
    ],
)
def test_connector_aliases(given, canonical):
    assert cfg(connector=given).connector == canonical


def test_full_valid_config():
    c = cfg(
        role="attention",
        connector="tcp",
        host="10.0.0.5",
        port=40000,
        num_attention_ranks=4,
        num_ffn_ranks=2,
        compute_gate_on_attention=True,
        timeout_s=5,
        connector_extra_config={"secret_env": "MY_SECRET"},
        rank=3,
    )
    assert c.connector == "gloo"
    assert c.timeout_s == 5
    assert c.rank == 3
    assert c.attention_ranks_per_ffn == 2
    assert "connector_extra_config" not in str(c)
    assert str(c).startswith("AFDConfig(role='attention'")


def test_connector_extra_config_none_becomes_empty():
    assert cfg(connector_extra_config=None).connector_extra_config == {}


def test_config_is_frozen():
    c = cfg()
    with pytest.raises(AttributeError):
        c.port = 1


def test_from_dict_passes_through_config():
    c = cfg()
    assert AFDConfig.from_dict(c) is c


def test_from_json():
    c = AFDConfig.from_json('{"role": "ffn", "connector": "tcp", "port": 1234}')
    assert (c.role, c.connector, c.port) == ("ffn", "gloo", 1234)


def test_from_engine_args_routes():
    assert AFDConfig.from_engine_args(None, None) is None
    assert AFDConfig.from_engine_args(None, {}) is None
    assert AFDConfig.from_engine_args(None, {"other": 1}) is None
    c = AFDConfig.from_engine_args('{"role": "ffn"}', None)
    assert c.role == "ffn"
    c = AFDConfig.from_engine_args({"role": "attention"}, {"unrelated": True})
    assert c.role == "attention"
    c = AFDConfig.from_engine_args(None, {"afd": {"role": "ffn", "connector": "nccl"}})
    assert (c.role, c.connector) == ("ffn", "nccl")


def test_from_engine_args_additional_config_names_its_source():
    with pytest.raises(AFDConfigError, match=r"^--additional-config afd: 'role' is required"):
        AFDConfig.from_engine_args(None, {"afd": {"connector": "tcp"}})


def test_from_engine_args_both_is_an_error():
    with pytest.raises(AFDConfigError, match="AFD is configured twice"):
        AFDConfig.from_engine_args('{"role": "ffn"}', {"afd": {"role": "ffn"}})
    with pytest.raises(AFDConfigError, match="not both"):
        AFDConfig.from_engine_args({"role": "ffn"}, {"afd": {"role": "attention"}})


# -------------------------------------------------------------------- bad
BAD = [
    # (raw dict, regex the message must match)
    ({"role": "ffn", "bogus": 1}, r"unknown key\(s\) 'bogus'; allowed keys: role, connector"),
    ({"role": "ffn", "zz": 1, "aa": 2}, r"unknown key\(s\) 'aa', 'zz'"),
    ({"connector": "tcp"}, r"'role' is required \('attention' or 'ffn'\)"),
    ({"role": "prefill"}, r"'role' must be one of attention, ffn; got 'prefill'"),
    ({"role": "FFN"}, r"'role' must be one of attention, ffn; got 'FFN'"),
    ({"role": 1}, r"'role' must be one of attention, ffn; got 1"),
    ({"role": ["ffn"]}, r"'role' must be one of attention, ffn; got \['ffn'\]"),
    ({"role": "ffn", "connector": "mooncake"}, r"unknown connector 'mooncake'; known: cuda_ipc, gloo, ipc, nccl"),
    ({"role": "ffn", "connector": 3}, r"'connector' must be a string; got int"),
    ({"role": "ffn", "connector_extra_config": {"ffn_cuda_graphs": "yes"}},
     r"connector_extra_config\.ffn_cuda_graphs must be true or false; got 'yes'"),
    ({"role": "attention", "connector_extra_config": {"early_step_control": 1}},
     r"connector_extra_config\.early_step_control must be true or false; got 1"),
    ({"role": "ffn", "connector": "cuda_ipc", "connector_extra_config": {"ffn_hot_poll": "no"}},
     r"connector_extra_config\.ffn_hot_poll must be true or false; got 'no'"),
    ({"role": "ffn", "connector_extra_config": {"ffn_cuda_graph_max_tokens": -1}},
     r"connector_extra_config\.ffn_cuda_graph_max_tokens must be an integer in 0\.\.\d+; got -1"),
    ({"role": "ffn", "connector_extra_config": {"ffn_cuda_graph_max_count": 2.5}},
     r"connector_extra_config\.ffn_cuda_graph_max_count must be an integer in 0\.\.4096; got 2\.5"),
    ({"role": "ffn", "connector_extra_config": {"ffn_cuda_graph_window": "8"}},
     r"connector_extra_config\.ffn_cuda_graph_window must be an integer in 0\.\.\d+; got '8'"),
    ({"role": "ffn", "connector": None}, r"'connector' must be a string; got NoneType"),
    ({"role": "ffn", "host": ""}, r"'host' must not be empty"),
    ({"role": "ffn", "host": "   "}, r"'host' must not be empty"),
    ({"role": "ffn", "host": 127}, r"'host' must be a string; got int"),
    ({"role": "ffn", "port": 0}, r"'port' must be in 1\.\.65535; got 0"),
    ({"role": "ffn", "port": 70000}, r"'port' must be in 1\.\.65535; got 70000"),
    ({"role": "ffn", "port": -1}, r"'port' must be in 1\.\.65535; got -1"),
    ({"role": "ffn", "port": "29600"}, r"'port' must be an integer; got '29600'"),
    ({"role": "ffn", "port": True}, r"'port' must be an integer; got True"),
    ({"role": "ffn", "port": 29600.0}, r"'port' must be an integer; got 29600\.0"),
    (
        {"role": "ffn", "port": 65535, "num_attention_ranks": 2, "num_ffn_ranks": 2},
        r"FFN rank ports 65535\.\.65536 exceed 65535",
    ),
    ({"role": "ffn", "num_attention_ranks": 0}, r"'num_attention_ranks' must be at least 1; got 0"),
    ({"role": "ffn", "num_ffn_ranks": -1}, r"'num_ffn_ranks' must be at least 1; got -1"),
    ({"role": "ffn", "num_attention_ranks": 2.0}, r"'num_attention_ranks' must be an integer; got 2\.0"),
    ({"role": "ffn", "num_ffn_ranks": 1.5}, r"'num_ffn_ranks' must be an integer; got 1\.5"),
    ({"role": "ffn", "num_ffn_ranks": True}, r"'num_ffn_ranks' must be an integer; got True"),
    (
        {"role": "ffn", "num_attention_ranks": 1, "num_ffn_ranks": 2},
        r"num_attention_ranks \(1\) must be >= num_ffn_ranks \(2\)",
    ),
    (
        {"role": "ffn", "num_attention_ranks": 3, "num_ffn_ranks": 2},
        r"num_attention_ranks \(3\) must be a multiple of num_ffn_ranks \(2\)",
    ),
    (
        {"role": "ffn", "compute_gate_on_attention": "yes"},
        r"'compute_gate_on_attention' must be true or false; got 'yes'",
    ),
    (
        {"role": "ffn", "compute_gate_on_attention": 1},
        r"'compute_gate_on_attention' must be true or false; got 1",
    ),
    ({"role": "ffn", "timeout_s": 0}, r"'timeout_s' must be a positive number of seconds; got 0"),
    ({"role": "ffn", "timeout_s": -5}, r"'timeout_s' must be a positive number of seconds; got -5"),
    (
        {"role": "ffn", "timeout_s": math.nan},
        r"'timeout_s' must be a positive number of seconds; got nan",
    ),
    (
        {"role": "ffn", "timeout_s": math.inf},
        r"'timeout_s' must be a positive number of seconds; got inf",
    ),
    ({"role": "ffn", "timeout_s": "60"}, r"'timeout_s' must be a number of seconds; got '60'"),
    ({"role": "ffn", "timeout_s": True}, r"'timeout_s' must be a number of seconds; got True"),
    ({"role": "ffn", "timeout_s": None}, r"'timeout_s' must be a number of seconds; got None"),
    (
        {"role": "ffn", "connector_extra_config": [1, 2]},
        r"'connector_extra_config' must be a JSON object; got list",
    ),
    (
        {"role": "ffn", "connector_extra_config": "secret_env=X"},
        r"'connector_extra_config' must be a JSON object; got str",
    ),
    (
        {"role": "ffn", "connector_extra_config": {1: "x"}},
        r"'connector_extra_config' keys must be strings",
    ),
    (
        {"role": "ffn", "connector_extra_config": {"secret_env": 5}},
        r"connector_extra_config\.secret_env must be a non-empty string; got 5",
    ),
    (
        {"role": "ffn", "rank": 1},
        r"'rank' 1 is out of range for role 'ffn' \(0\.\.0\)",
    ),
    (
        {"role": "attention", "rank": 4, "num_attention_ranks": 4, "num_ffn_ranks": 2},
        r"'rank' 4 is out of range for role 'attention' \(0\.\.3\)",
    ),
    (
        {"role": "ffn", "rank": 2, "num_attention_ranks": 4, "num_ffn_ranks": 2},
        r"'rank' 2 is out of range for role 'ffn' \(0\.\.1\)",
    ),
    ({"role": "attention", "rank": -1}, r"'rank' -1 is out of range for role 'attention'"),
    ({"role": "attention", "rank": "0"}, r"'rank' must be an integer; got '0'"),
    ({"role": "attention", "rank": 0.0}, r"'rank' must be an integer; got 0\.0"),
    ({"role": "attention", "rank": False}, r"'rank' must be an integer; got False"),
]


def _id(case):
    raw, _ = case
    return json.dumps({k: v for k, v in raw.items() if k != "role"} or raw, default=repr)[:60]


@pytest.mark.parametrize("raw, message", BAD, ids=[_id(c) for c in BAD])
def test_bad_config(raw, message):
    with pytest.raises(AFDConfigError, match=r"^--afd-config: .*" + message):
        AFDConfig.from_dict(raw)


# Numbers of the right type but outside their bounds: before, each was accepted and then
# crashed or misbehaved (timeout_s 1e10: OverflowError in settimeout at connect; 1e-7: the
# heartbeat waited 25 ns between beats; 10**9 attention ranks: rank lists of that size).
OUT_OF_BOUNDS = [
    ({"role": "ffn", "timeout_s": 1e10}, r"'timeout_s' must be between 0\.5 and 86400 seconds; got 1e\+10"),
    ({"role": "ffn", "timeout_s": 1e-7}, r"'timeout_s' must be between 0\.5 and 86400 seconds; got 1e-07"),
    ({"role": "ffn", "timeout_s": 0.49}, r"'timeout_s' must be between 0\.5 and 86400 seconds; got 0\.49"),
    ({"role": "ffn", "timeout_s": 86401}, r"'timeout_s' must be between .*; got 86401"),
    ({"role": "attention", "rejoin_timeout_s": 1e300},
     r"'rejoin_timeout_s' must be at most 86400 seconds \(0 turns rejoining off\); got 1e\+300"),
    ({"role": "attention", "rejoin_timeout_s": 86400.5}, r"'rejoin_timeout_s' must be at most 86400"),
    ({"role": "ffn", "num_attention_ranks": 10**9},
     r"'num_attention_ranks' must be at most 1024; got 1000000000"),
    ({"role": "ffn", "num_attention_ranks": 2048, "num_ffn_ranks": 2048, "port": 1000},
     r"'num_attention_ranks' must be at most 1024; got 2048"),
    ({"role": "ffn", "num_attention_ranks": 1025}, r"'num_attention_ranks' must be at most 1024"),
    ({"role": "attention", "dbo_min_tokens": 2**31}, r"'dbo_min_tokens' must be at most 2147483647"),
    ({"role": "attention", "dbo_min_tokens": 10**30}, r"'dbo_min_tokens' must be at most 2147483647"),
]


@pytest.mark.parametrize("raw, message", OUT_OF_BOUNDS, ids=[_id(c) for c in OUT_OF_BOUNDS])
def test_numbers_out_of_bounds_are_refused_naming_the_key(raw, message):
    with pytest.raises(AFDConfigError, match=r"^--afd-config: .*" + message):
        AFDConfig.from_dict(raw)


def test_numbers_at_their_bounds_are_accepted():
    for raw in (
        {"role": "ffn", "timeout_s": 0.5, "rejoin_timeout_s": 86400},
        {"role": "ffn", "timeout_s": 86400, "rejoin_timeout_s": 0},
        {"role": "ffn", "num_attention_ranks": 1024, "num_ffn_ranks": 1024, "port": 1000,
         "rank": 1023},
        {"role": "attention", "dbo_min_tokens": 2**31 - 1, "port": 65535},
    ):
        AFDConfig.from_dict(raw)


def test_at_least_twenty_distinct_bad_inputs():
    assert len({m for _, m in BAD}) >= 20


def test_error_is_a_value_error():
    assert issubclass(AFDConfigError, ValueError)


@pytest.mark.parametrize(
    "raw, kind",
    [([{"role": "ffn"}], "list"), ("ffn", "str"), (None, "NoneType"), (3, "int")],
)
def test_not_a_json_object(raw, kind):
    with pytest.raises(AFDConfigError, match=rf"^--afd-config: expected a JSON object, got {kind}$"):
        AFDConfig.from_dict(raw)


def test_from_json_list():
    with pytest.raises(AFDConfigError, match=r"expected a JSON object, got list"):
        AFDConfig.from_json('[{"role": "ffn"}]')


@pytest.mark.parametrize("text", ["{role: ffn}", "", '{"role": "ffn"', "{'role': 'ffn'}"])
def test_from_json_invalid(text):
    with pytest.raises(AFDConfigError, match=r"^--afd-config: not valid JSON \(.* at \d+\)$"):
        AFDConfig.from_json(text)


def test_from_json_error_names_custom_source():
    with pytest.raises(AFDConfigError, match=r"^my-source: 'role' is required"):
        AFDConfig.from_json("{}", source="my-source")


# ------------------------------------------------------------------ argparse
def test_parse_afd_config_arg_ok():
    c = afd.parse_afd_config_arg('{"role": "attention", "connector": "tcp"}')
    assert isinstance(c, AFDConfig)
    assert c.connector == "gloo"


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", r"not valid JSON"),
        ('{"role": "x"}', r"'role' must be one of attention, ffn"),
        ('{"role": "ffn", "port": 0}', r"'port' must be in 1\.\.65535"),
    ],
)
def test_parse_afd_config_arg_raises_argument_type_error(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        afd.parse_afd_config_arg(text)


def test_parse_afd_config_arg_in_argparse(capsys):
    parser = argparse.ArgumentParser(prog="serve")
    parser.add_argument("--afd-config", type=afd.parse_afd_config_arg)
    ns = parser.parse_args(["--afd-config", '{"role": "ffn"}'])
    assert ns.afd_config.role == "ffn"
    with pytest.raises(SystemExit):
        parser.parse_args(["--afd-config", '{"role": "ffn", "nope": 1}'])
    err = capsys.readouterr().err
    assert "unknown key(s) 'nope'" in err


# ----------------------------------------------------- verify_with_vllm_config
def _vllm(tp=1, pp=1, spec=None, parallel=True, dp=1, ep=False, device_type="cpu"):
    return SimpleNamespace(
        parallel_config=(
            SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            data_parallel_size=dp, enable_expert_parallel=ep)
            if parallel else None
        ),
        speculative_config=spec,
        device_config=SimpleNamespace(device_type=device_type),
    )


def test_verify_ok():
    cfg().verify_with_vllm_config(_vllm())
    cfg().verify_with_vllm_config(_vllm(parallel=False))
    cfg().verify_with_vllm_config(SimpleNamespace())


@pytest.mark.parametrize(
    "vllm_config, message",
    [
        (_vllm(tp=2), r"tensor parallelism on the attention role is not supported yet "
                      r"\(got tensor_parallel_size=2\)"),
        (_vllm(pp=2), r"pipeline parallelism inside a role is not supported "
                      r"\(got pipeline_parallel_size=2\)"),
        (_vllm(tp=4, pp=2), r"pipeline_parallel_size=2"),
        (_vllm(spec=SimpleNamespace(method="eagle")), r"speculative decoding is not supported"),
    ],
)
def test_verify_refuses(vllm_config, message):
    with pytest.raises(AFDConfigError, match=message):
        cfg().verify_with_vllm_config(vllm_config)


# ------------------------------------------------------------------ FFN group
def _group(**kw):
    return cfg(**{"role": "ffn", "num_attention_ranks": 2, "num_ffn_ranks": 2, **kw})


def test_ffn_group_ok():
    """One FFN server of num_ffn_ranks tensor-parallel workers (FFN ranks 0..N-1)."""
    _group().verify_with_vllm_config(_vllm(tp=2))
    cfg(role="ffn", num_attention_ranks=4, num_ffn_ranks=2).verify_with_vllm_config(_vllm(tp=2))
    # Expert parallel within the group where vLLM's MoE kernels take the expert map.
    _group().verify_with_vllm_config(_vllm(tp=2, ep=True, device_type="cuda"))
    # N FFN servers of one worker each (replicas, each with a rank) stay as they were.
    _group(rank=1).verify_with_vllm_config(_vllm())


@pytest.mark.parametrize(
    "config, vllm_config, message",
    [
        (_group(num_ffn_ranks=1), _vllm(tp=2),
         r"tensor_parallel_size=2 runs that many FFN ranks as one group, so num_ffn_ranks "
         r"must be 2 \(got 1\)"),
        (_group(num_attention_ranks=4), _vllm(tp=4),
         r"num_ffn_ranks must be 4 \(got 2\)"),
        (_group(), _vllm(tp=2, dp=2), r"FFN group .* needs data_parallel_size 1"),
        (_group(rank=0), _vllm(tp=2), r"drop 'rank' from the --afd-config of an FFN group"),
        (_group(), _vllm(tp=2, ep=True),
         r"--enable-expert-parallel is not supported on the CPU: vLLM's CPU MoE kernels "
         r"ignore the expert map"),
        (_group(connector="cuda_ipc"), _vllm(tp=2, device_type="cuda"),
         r"an FFN group \(tensor_parallel_size 2\) runs with connector 'gloo'"),
        (cfg(role="attention", num_attention_ranks=2, num_ffn_ranks=2), _vllm(tp=2),
         r"tensor parallelism on the attention role"),
    ],
)
def test_ffn_group_refusals(config, vllm_config, message):
    with pytest.raises(AFDConfigError, match=message):
        config.verify_with_vllm_config(vllm_config)


# ---------------------------------------------------------------- rank layout
def test_layout_4a2f():
    c = cfg(num_attention_ranks=4, num_ffn_ranks=2, port=30000)
    assert c.attention_ranks_per_ffn == 2
    assert [c.ffn_rank_of(a) for a in range(4)] == [0, 0, 1, 1]
    assert c.attention_ranks_of(0) == [0, 1]
    assert c.attention_ranks_of(1) == [2, 3]
    assert [c.ffn_port(f) for f in range(2)] == [30000, 30001]


def test_layout_3a1f():
    c = cfg(num_attention_ranks=3, num_ffn_ranks=1, port=30000)
    assert c.attention_ranks_per_ffn == 3
    assert [c.ffn_rank_of(a) for a in range(3)] == [0, 0, 0]
    assert c.attention_ranks_of(0) == [0, 1, 2]
    assert c.ffn_port(0) == 30000


def test_layout_1a1f():
    c = cfg()
    assert c.ffn_rank_of(0) == 0
    assert c.attention_ranks_of(0) == [0]
    assert c.ffn_port(0) == 29600


def test_layout_every_attention_rank_served_once():
    c = cfg(num_attention_ranks=6, num_ffn_ranks=3)
    served = [a for f in range(3) for a in c.attention_ranks_of(f)]
    assert served == list(range(6))
    assert all(c.ffn_rank_of(a) == f for f in range(3) for a in c.attention_ranks_of(f))


# ---------------------------------------------------------------- compute_hash
def test_compute_hash_stable():
    a = cfg(role="ffn", num_attention_ranks=2)
    b = cfg(role="ffn", num_attention_ranks=2)
    assert a.compute_hash() == b.compute_hash() == a.compute_hash()
    h = a.compute_hash()
    assert isinstance(h, str) and len(h) == 32
    int(h, 16)


def test_compute_hash_ignores_address_and_timeouts():
    base = cfg(role="ffn").compute_hash()
    assert cfg(role="ffn", host="10.1.2.3", port=40000).compute_hash() == base
    assert cfg(role="ffn", timeout_s=3).compute_hash() == base
    assert cfg(role="ffn", connector="tcp").compute_hash() == base  # alias == canonical


@pytest.mark.parametrize(
    "change",
    [
        {"role": "attention"},
        {"num_attention_ranks": 2},
        {"num_attention_ranks": 2, "num_ffn_ranks": 2},
        {"compute_gate_on_attention": True},
        {"connector": "nccl"},
    ],
)
def test_compute_hash_changes_with_role_and_topology(change):
    base = cfg(role="ffn").compute_hash()
    assert cfg(**{"role": "ffn", **change}).compute_hash() != base


def _gpu_vllm(device_type="cuda", enforce_eager=False):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None,
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        device_config=SimpleNamespace(device_type=device_type),
    )


def test_verify_forces_eager_on_gpu_attention():
    v = _gpu_vllm()
    cfg(role="attention").verify_with_vllm_config(v)
    assert v.model_config.enforce_eager is True


def test_verify_keeps_graphs_with_cuda_ipc():
    v = _gpu_vllm()
    cfg(role="attention", connector="cuda_ipc").verify_with_vllm_config(v)
    assert v.model_config.enforce_eager is False


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_verify_refuses_cuda_ipc_off_cuda(role):
    with pytest.raises(AFDConfigError, match=r"connector 'cuda_ipc' runs on cuda .* this engine runs on 'cpu'.* gloo"):
        cfg(role=role, connector="ipc").verify_with_vllm_config(_gpu_vllm(device_type="cpu"))


@pytest.mark.parametrize(
    "role, device_type", [("ffn", "cuda"), ("attention", "cpu")]
)
def test_verify_leaves_eager_alone(role, device_type):
    v = _gpu_vllm(device_type=device_type)
    cfg(role=role).verify_with_vllm_config(v)
    assert v.model_config.enforce_eager is False


# ------------------------------------------------------------------------ DBO
def _dbo_vllm(device_type="cpu", dp=1, dbo=True, num_ubatches=2, mla=True):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        enable_dbo=dbo, data_parallel_size=dp,
                                        num_ubatches=num_ubatches),
        speculative_config=None,
        model_config=SimpleNamespace(enforce_eager=True, use_mla=mla),
        device_config=SimpleNamespace(device_type=device_type),
    )


def test_verify_dbo_ok_on_the_cpu_with_gloo():
    cfg(role="attention").verify_with_vllm_config(_dbo_vllm())
    cfg(role="attention").verify_with_vllm_config(_dbo_vllm(mla=False))  # any attention
    cfg(role="ffn").verify_with_vllm_config(_dbo_vllm(dbo=False))


def test_verify_dbo_ok_on_cuda_with_cuda_ipc():
    cfg(role="attention", connector="cuda_ipc").verify_with_vllm_config(_dbo_vllm("cuda"))
    # FLASH_ATTN models too (patch ubatch-metadata-cache: one attention-metadata cache entry per micro-batch)
    cfg(role="attention", connector="cuda_ipc").verify_with_vllm_config(
        _dbo_vllm("cuda", mla=False))


def test_verify_dbo_refused_on_the_ffn_role():
    with pytest.raises(AFDConfigError, match=r"--enable-dbo is an attention-server option"):
        cfg(role="ffn").verify_with_vllm_config(_dbo_vllm())


@pytest.mark.parametrize(
    "vllm_config, connector, message",
    [
        (_dbo_vllm(dp=2), "gloo", r"--enable-dbo on the attention role needs data_parallel_size "
                                  r"1 \(got 2\)"),
        (_dbo_vllm(device_type="cuda"), "nccl",
         r"not supported with connector 'nccl' .*gloo on cpu, cuda_ipc on cuda"),
        (_dbo_vllm(device_type="cuda"), "gloo", r"--enable-dbo on 'cuda' is not supported "
                                                r"with connector 'gloo'.*cuda_ipc on cuda"),
        (_dbo_vllm(device_type="xpu"), "gloo", r"--enable-dbo on 'xpu' is not supported"),
        (_dbo_vllm(device_type="cuda", num_ubatches=3), "cuda_ipc",
         r"cuda_ipc connector serves at most 2 micro-batches per step.*asks for 3"),
    ],
)
def test_verify_dbo_refuses(vllm_config, connector, message):
    with pytest.raises(AFDConfigError, match=message):
        cfg(role="attention", connector=connector).verify_with_vllm_config(vllm_config)


# ----------------------------------------------------- tokens of one FFN pass
def _ffn(m=4, n=1, per_pass=None) -> AFDConfig:
    extra = {} if per_pass is None else {"ffn_max_tokens_per_pass": per_pass}
    return cfg(role="ffn", num_attention_ranks=m, num_ffn_ranks=n, connector_extra_config=extra)


def test_ffn_pass_tokens_default_is_one_step():
    """k x max_num_batched_tokens is what a pass of k batched steps could reach: by default
    a pass holds at most one plain engine step's tokens."""
    assert _ffn(m=4).ffn_pass_tokens(512) == 512
    assert _ffn(m=1).ffn_pass_tokens(512) == 512


def test_ffn_pass_tokens_set_and_capped_at_k_steps():
    assert _ffn(m=4, per_pass=1024).ffn_pass_tokens(512) == 1024
    assert _ffn(m=4, per_pass=10**9).ffn_pass_tokens(512) == 4 * 512
    assert _ffn(m=4, n=2, per_pass=10**9).ffn_pass_tokens(512) == 2 * 512  # k = M / N


def test_ffn_pass_tokens_below_one_step_refused():
    with pytest.raises(AFDConfigError, match=r"ffn_max_tokens_per_pass \(256\) must be at least "
                                             r"max_num_batched_tokens \(512\)"):  # fmt: skip
        _ffn(per_pass=256).ffn_pass_tokens(512)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "512"])
def test_ffn_max_tokens_per_pass_must_be_a_positive_integer(bad):
    with pytest.raises(AFDConfigError, match=r"ffn_max_tokens_per_pass must be an integer in 1\.\.\d+; got"):
        _ffn(per_pass=bad)


def test_verify_refuses_an_ffn_pass_below_max_num_batched_tokens():
    v = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=2048))
    _ffn(per_pass=2048).verify_with_vllm_config(v)
    with pytest.raises(AFDConfigError, match=r"\(1024\) must be at least max_num_batched_tokens"):
        _ffn(per_pass=1024).verify_with_vllm_config(v)
    # the key is the FFN's: an attention server with it is not refused
    cfg(connector_extra_config={"ffn_max_tokens_per_pass": 1024}).verify_with_vllm_config(v)


def test_ffn_pass_message():
    assert _ffn(m=1).ffn_pass_message(0, 512) == (
        "AFD FFN rank 0: at most 512 tokens per pass (k=1 attention rank x 512 "
        "max_num_batched_tokens = 512)"
    )
    assert _ffn(m=4, n=2).ffn_pass_message(1, 512) == (
        "AFD FFN rank 1: at most 512 tokens per pass (k=2 attention ranks x 512 "
        "max_num_batched_tokens = 1024; steps beyond it are served in several passes, "
        "connector_extra_config.ffn_max_tokens_per_pass raises it)"
    )
    assert _ffn(m=4, n=2, per_pass=4096).ffn_pass_message(0, 512, group_size=2) == (
        "AFD FFN rank 0: at most 1024 tokens per pass (k=2 attention ranks x 512 "
        "max_num_batched_tokens = 1024; a pass of this FFN group gathers up to 2048 tokens "
        "of its 2 members)"
    )
