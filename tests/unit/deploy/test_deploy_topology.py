"""vllm.afd.deploy's topology file: every refusal names its field, the derived --afd-config
and `vllm serve` command of each server, the CLI's validate/render and the missing-Ray
error; the relay that carries an attention rank to a moved FFN rank (vllm.afd.deploy.actors)."""

from __future__ import annotations

import copy
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm.afd.deploy import actors, topology
from vllm.afd.deploy.topology import TopologyError, validate

GOLDEN = Path(__file__).resolve().with_name("deploy_golden")

BASE = {
    "name": "t",
    "model": "/models/m",
    "connector": "gloo",
    "attention": {"ranks": 2, "resources": {"cpus": 2}},
    "ffn": {"ranks": 1, "resources": {"gpus": 1}},
}


def topo(**changes) -> dict:
    """BASE with ``changes``: "attention.ranks" style keys set (None deletes)."""
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = raw
        for key in path:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return raw


@pytest.mark.parametrize("changes, field, text", [
    ({"attention__max_ranks": 3, "ffn__ranks": 2, "attention__ranks": 2}, "attention.max_ranks",
     "multiple of ffn.ranks"),
    ({"attention__ranks": 3, "attention__max_ranks": 2}, "attention.max_ranks", ">= attention.ranks"),
    ({"ffn__ranks": 0}, "ffn.ranks", "integer >= 1"),
    ({"attention__ranks": 1, "attention__max_ranks": 2, "ffn__ranks": 2}, "attention.ranks",
     "at least ffn.ranks"),
    ({"attention__resources": None}, "attention.resources", "is required"),
    ({"ffn__resources": {"memory": "8Gi"}}, "ffn.resources", "neither gpus nor cpus"),
    ({"ffn__resources": {"gpus": -1}}, "ffn.resources.gpus", "integer >= 0"),
    ({"ffn__resources": {"gpus": 1, "ray_resources": {"GPU": 1}}},
     "ffn.resources.ray_resources.GPU", "set by cpus/gpus"),
    ({"connector": "cuda_ipc"}, "connector", "cannot cross hosts"),
    ({"connector": "ipc", "placement": "multi_host"}, "connector", "cannot cross hosts"),
    ({"connector": "carrier-pigeon"}, "connector", "unknown connector"),
    ({"ffn__ranks": 2, "ffn__layout": "group", "afd__connector_extra_config":
      {"ffn_failover": True}}, "afd.connector_extra_config.ffn_failover", "replicas"),
    ({"ffn__layout": "group"}, "ffn.layout", "ffn.ranks >= 2"),
    ({"ffn__layout": "ring"}, "ffn.layout", "one of replicas, group"),
    ({"placement": "everywhere"}, "placement", "one of"),
    ({"attention__serve_args": ["--port", "9"]}, "attention.serve_args", "--port is set by"),
    ({"ffn__serve_args": ["--tensor-parallel-size=2"]}, "ffn.serve_args", "set by the launcher"),
    ({"attention__serve_args": ["--additional-config", "{}"]}, "attention.serve_args",
     "`afd` section"),
    ({"attention__serve_args": "--enforce-eager"}, "attention.serve_args", "list of strings"),
    ({"attention__http_port": 8100}, "ffn.http_port", "overlap attention.http_port"),
    ({"ffn__afd_port": 8001}, "ffn.afd_port", "overlap attention.http_port"),
    ({"ffn__afd_port": 70000}, "ffn.afd_port", "1..65535"),
    ({"env": {"VLLM_AFD_SECRET": "x"}}, "env.VLLM_AFD_SECRET", "not written into a topology"),
    ({"name": "Bad_Name"}, "name", "DNS label"),
    ({"model": None}, "model", "is required"),
    ({"attention__replicas": 2}, "attention", "unknown key(s) 'replicas'"),
    ({"color": "blue"}, "the topology", "unknown key(s) 'color'"),
    ({"afd__role": "ffn"}, "afd", "unknown key(s) 'role'"),
    ({"afd__timeout_s": -1}, "afd", "'timeout_s' must be a positive number"),
    ({"ray__relay": "yes"}, "ray.relay", "true or false"),
])  # fmt: skip
def test_refusals_name_the_field(changes, field, text):
    with pytest.raises(TopologyError) as e:
        validate(topo(**changes), source="t.json")
    assert f"t.json: {field}: " in str(e.value), str(e.value)
    assert text in str(e.value), str(e.value)


def test_a_records_limit_of_ffn_ranks_is_named(monkeypatch):
    """No connector has a limit now (nccl served one FFN rank before its communicator per
    session); a record that declares one is what refuses more."""
    import dataclasses

    from vllm.afd.connector_spec import SPECS

    assert validate(topo(connector="nccl", ffn__ranks=2, attention__ranks=2)).connector == "nccl"
    monkeypatch.setitem(SPECS, "nccl", dataclasses.replace(SPECS["nccl"], max_ffn_ranks=1))
    with pytest.raises(TopologyError) as e:
        validate(topo(connector="nccl", ffn__ranks=2, attention__ranks=2), source="t.json")
    assert "t.json: ffn.ranks: " in str(e.value) and "at most 1" in str(e.value)


@pytest.mark.parametrize("connector, placement, relayed", [
    ("gloo", "multi_host", True), ("tcp", "multi_host", True), ("nixl", "multi_host", True),
    ("nccl", "multi_host", True), ("cuda_ipc", "one_host", False),
    ("gloo", "one_host", True)])  # fmt: skip
def test_connectors_and_placements_accepted(connector, placement, relayed):
    t = validate(topo(connector=connector, placement=placement))
    assert t.connector == {"tcp": "gloo"}.get(connector, connector)
    # the Ray launcher relays the connectors that rejoin through their control channel
    assert t.relayed is relayed
    assert not validate(topo(connector=connector, placement=placement,
                             ray={"relay": False})).relayed  # fmt: skip


def test_derived_configs_of_replicas_with_spare_slots():
    t = validate(topo(attention__ranks=4, attention__max_ranks=6, ffn__ranks=2,
                      afd__timeout_s=30, afd__connector_extra_config={"ffn_failover": True}))  # fmt: skip
    assert [s.name for s in t.ffn_servers()] == ["ffn-0", "ffn-1"]
    assert [s.http_port for s in t.attention_servers()] == [8000 + a for a in range(6)]
    assert t.initial_slots() == [0, 1, 3, 4]  # slot 0 and 1 of each FFN rank's three
    assert t.elastic and t.relayed
    addrs = ["a:1", "b:2"]
    att = t.afd_config(t.attention_servers()[4], "h", addrs)
    assert att == {"role": "attention", "connector": "gloo", "host": "h", "port": 29600,
                   "num_attention_ranks": 6, "num_ffn_ranks": 2, "ffn_addresses": addrs,
                   "timeout_s": 30, "connector_extra_config": {"ffn_failover": True},
                   "rank": 4}  # fmt: skip
    ffn = t.afd_config(t.ffn_servers()[1], "0.0.0.0", addrs)
    assert ffn["rank"] == 1 and ffn["role"] == "ffn"
    assert ffn["connector_extra_config"] == {"ffn_failover": True,
                                             topology.ELASTIC_KEY: True}  # fmt: skip
    argv = t.command(t.ffn_servers()[1], "10.0.0.7", "10.0.0.7", addrs, python="py")
    assert argv[:9] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m", "--host",
                        "10.0.0.7", "--port", "8101"]  # fmt: skip
    assert json.loads(argv[argv.index("--afd-config") + 1])["host"] == "10.0.0.7"


def test_group_runs_every_ffn_rank_in_one_server():
    t = validate(topo(attention__ranks=4, ffn__ranks=2, ffn__layout="group",
                      ffn__resources={"gpus": 1, "cpus": 4}))  # fmt: skip
    (server,) = t.ffn_servers()
    assert server.name == "ffn-group" and server.ffn_ranks == (0, 1)
    assert (server.resources.gpus, server.resources.cpus) == (2, 8.0)
    assert "rank" not in t.afd_config(server, "0.0.0.0", ["x:1", "x:2"])
    assert t.serve_args(server)[-2:] == ["--tensor-parallel-size", "2"]
    assert not t.elastic  # every slot runs: no empty slot for the FFN ranks to serve around
    assert topology.ELASTIC_KEY not in t.afd_config(server, "h", ["x:1", "x:2"]).get(
        "connector_extra_config", {})  # fmt: skip


def test_yaml_and_json_files(tmp_path):
    t = topology.load(GOLDEN / "4a2f_group" / "topology.yaml")
    assert t.ffn.layout == "group" and t.num_attention_ranks == 4
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",')
    with pytest.raises(TopologyError, match="not valid JSON"):
        topology.load(bad)
    with pytest.raises(TopologyError, match="cannot read the topology file"):
        topology.load(tmp_path / "missing.json")


def test_cli_validate_and_render(tmp_path, capsys):
    from vllm.afd.deploy.__main__ import main

    assert main(["validate", str(GOLDEN / "1a1f" / "topology.json")]) == 0
    assert "ffn-0: port 8100" in capsys.readouterr().out
    assert main(["render", str(GOLDEN / "1a1f" / "topology.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "kubernetes" / "01-statefulset-qwen-1a1f-ffn.yaml").is_file()
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps(topo(connector="cuda_ipc")))
    assert main(["validate", str(bad)]) == 2
    assert "connector: 'cuda_ipc' moves activations" in capsys.readouterr().err


def test_launcher_without_ray_says_pip_install_ray(monkeypatch):
    from vllm.afd.deploy import ray_launcher

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ray_launcher.DeployError, match="pip install ray"):
        ray_launcher.import_ray()


# ---------------------------------------------------------------- the relay
class Echo:
    """A TCP echo server on 127.0.0.1 that can be killed (its connections closed)."""

    def __init__(self, tag: bytes):
        self.tag = tag
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    def _echo(self, c):
        try:
            while data := c.recv(65536):
                c.sendall(self.tag + data)
        except OSError:
            pass

    def kill(self):
        """As the kernel does for a killed process: its sockets are closed (FIN)."""
        self.sock.close()
        for c in self.conns:
            c.shutdown(socket.SHUT_RDWR)
            c.close()


def roundtrip(address: str, payload: bytes) -> bytes:
    host, port = actors.split_address(address)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(65536)


def test_relay_follows_its_target_and_closes_both_sides():
    a, b = Echo(b"A:"), Echo(b"B:")
    target = [("127.0.0.1", a.port)]
    relay = actors.Relay(lambda: target[0], wait_s=5.0)
    try:
        assert roundtrip(relay.address, b"x") == b"A:x"
        # a lost peer: the client's side of the relay ends (EOF) within a moment
        host, port = actors.split_address(relay.address)
        client = socket.create_connection((host, port), timeout=5)
        client.sendall(b"y")
        assert client.recv(100) == b"A:y"
        a.kill()
        client.settimeout(5)
        t0 = time.monotonic()
        assert client.recv(100) == b""
        assert time.monotonic() - t0 < 2
        client.close()
        # the target moves: the next connection reaches the new one
        target[0] = ("127.0.0.1", b.port)
        assert roundtrip(relay.address, b"z") == b"B:z"
        assert relay.connections == 3
    finally:
        relay.close()
        b.kill()


def test_relay_holds_a_connection_until_its_target_listens():
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()  # nothing listens there now
    relay = actors.Relay(lambda: ("127.0.0.1", free), wait_s=10.0)
    late: list[Echo] = []

    def start_later():
        time.sleep(1.0)
        e = Echo(b"L:")
        e.sock.close()
        e.sock = socket.create_server(("127.0.0.1", free))
        threading.Thread(target=e._accept, daemon=True).start()
        late.append(e)

    threading.Thread(target=start_later, daemon=True).start()
    try:
        t0 = time.monotonic()
        assert roundtrip(relay.address, b"q") == b"L:q"
        assert time.monotonic() - t0 >= 0.9
        short = actors.Relay(lambda: ("127.0.0.1", 1), wait_s=0.5)  # nothing ever listens
        host, p = actors.split_address(short.address)
        with socket.create_connection((host, p), timeout=5) as s:
            s.settimeout(5)
            assert s.recv(10) == b""  # closed after wait_s: the attention rank dials again
        short.close()
    finally:
        relay.close()
        for e in late:
            e.kill()


# A server that dials its relay, says hello, and says goodbye on SIGTERM (as an attention
# rank's engine does as it exits).
SAYS_GOODBYE = """
import signal, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=5)
s.sendall(b"hello;")
def bye(*_):
    s.sendall(b"goodbye;")
    s.close()
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
while True:
    time.sleep(0.1)
"""


def test_a_stopped_server_says_goodbye_through_its_relay(tmp_path):
    """Stopping a slot (a drained scale-down) ends the server first and its relays after:
    what the server sends as it exits (the attention rank's goodbye) reaches the FFN rank,
    which then lets the rank go instead of logging it lost."""
    upstream = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def read_all():
        conn, _ = upstream.accept()
        conn.settimeout(30)
        while chunk := conn.recv(100):
            got.extend(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    actor = actors.ServerActor("attention-0")
    (relay,) = actor.open_relays([f"127.0.0.1:{upstream.getsockname()[1]}"], wait_s=5.0)
    try:
        actor.start([sys.executable, "-c", SAYS_GOODBYE, relay], {}, str(tmp_path / "s.log"),
                    "http://127.0.0.1:1")  # fmt: skip
        deadline = time.monotonic() + 30
        while bytes(got) != b"hello;" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bytes(got) == b"hello;", (bytes(got), (tmp_path / "s.log").read_text())
        assert actor.stop(grace=10.0) == 0
        reader.join(10)
        assert bytes(got) == b"hello;goodbye;"
    finally:
        actor.stop(grace=1.0)  # nothing left when an assertion failed
        upstream.close()
