# SPDX-License-Identifier: Apache-2.0
"""The topology file of an AFD deployment: what runs where, validated field by field.

A topology names the model, the connector and, per role, the rank count, the ``vllm
serve`` arguments, the resources one rank needs and its ports (docs/deployment.md has an
example of every key). From it come every rank's ``--afd-config`` and ``vllm serve``
command, for the Ray launcher (``ray_launcher``) and for the Kubernetes manifests
(``render``) alike.

Attention slots: ``num_attention_ranks`` is part of every rank's configuration (the FFN
ranks' expected ranks, the fingerprint), so it cannot change while the deployment serves.
``attention.max_ranks`` reserves that many attention rank slots (num_attention_ranks =
max_ranks); ``attention.ranks`` of them are started, and ``scale attention N`` starts or stops
servers for slots. Slot a is served by FFN rank a // (max_ranks / ffn.ranks).

Pure Python (no vLLM, no Ray import at module level): each derived ``--afd-config`` is
checked with ``vllm.config.afd.AFDConfig`` (imported when :func:`validate` runs).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("attention", "ffn")
LAYOUTS = ("replicas", "group")
PLACEMENTS = ("multi_host", "one_host")
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
LABEL_RE = re.compile(r"^([a-z0-9A-Z.\-/_]{1,253})$")
# Flags of `vllm serve` the launcher sets itself (per rank and role).
RESERVED_FLAGS = ("--host", "--port", "--afd-config", "--data-parallel-size", "-dp",
                  "--headless")  # fmt: skip
# The AFDConfig keys a topology's `afd` section may set (the others come from the topology).
AFD_KEYS = ("timeout_s", "rejoin_timeout_s", "connector_extra_config",
            "compute_gate_on_attention", "dbo_min_tokens")  # fmt: skip
TOP_KEYS = ("name", "model", "connector", "placement", "afd", "env", "image", "secret",
            "attention", "ffn", "ray")  # fmt: skip
ROLE_KEYS = {
    "attention": ("ranks", "max_ranks", "serve_args", "resources", "http_port", "env"),
    "ffn": ("ranks", "layout", "serve_args", "resources", "http_port", "afd_port", "env"),
}
RESOURCE_KEYS = ("gpus", "cpus", "memory", "ray_resources", "node_labels")
RAY_KEYS = ("namespace", "start_timeout_s", "drain_timeout_s", "relay", "health_period_s",
            "log_dir", "internal_port_base")
SECRET_KEYS = ("name", "key")
# The FFN side's connector_extra_config key that lets attention slots stay empty (no
# start-up wait for every attention rank), set on the FFN servers of an elastic topology.
ELASTIC_KEY = "ffn_elastic_attention"


class TopologyError(ValueError):
    """A bad topology; the message names the field (``attention.resources.gpus``)."""


@dataclass(frozen=True)
class Resources:
    gpus: int = 0
    cpus: float = 1.0
    memory: str | None = None  # Kubernetes quantity ("16Gi"); Ray: not reserved
    ray_resources: dict[str, float] = field(default_factory=dict)
    node_labels: dict[str, str] = field(default_factory=dict)

    def scaled(self, n: int) -> Resources:
        """What a server hosting ``n`` ranks needs (an FFN group: n of its ranks)."""
        return Resources(self.gpus * n, self.cpus * n, self.memory, dict(self.ray_resources),
                         dict(self.node_labels))  # fmt: skip


@dataclass(frozen=True)
class Role:
    name: str
    ranks: int
    serve_args: tuple[str, ...]
    resources: Resources
    http_port: int
    env: dict[str, str]
    max_ranks: int = 0  # attention: slots (num_attention_ranks)
    layout: str = "replicas"  # ffn
    afd_port: int = 0  # ffn


@dataclass(frozen=True)
class Server:
    """One ``vllm serve`` process of the deployment: an attention slot, an FFN replica, or
    the one server of an FFN group (which hosts every FFN rank)."""

    role: str
    index: int  # the attention slot, the FFN replica's rank; 0 for an FFN group
    ffn_ranks: tuple[int, ...]  # the FFN ranks it hosts (FFN servers)
    http_port: int
    resources: Resources

    @property
    def name(self) -> str:
        if self.role == "ffn" and len(self.ffn_ranks) > 1:
            return "ffn-group"
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class Topology:
    name: str
    model: str
    connector: str
    placement: str
    afd: dict[str, Any]
    env: dict[str, str]
    image: str | None
    secret: dict[str, str]
    attention: Role
    ffn: Role
    ray: dict[str, Any]

    # ------------------------------------------------------------ derived
    @property
    def num_attention_ranks(self) -> int:
        return self.attention.max_ranks

    @property
    def num_ffn_ranks(self) -> int:
        return self.ffn.ranks

    @property
    def per_ffn(self) -> int:
        """Attention slots per FFN rank (k)."""
        return self.attention.max_ranks // self.ffn.ranks

    def ffn_rank_of(self, slot: int) -> int:
        return slot // self.per_ffn

    def afd_port(self, ffn_rank: int) -> int:
        return self.ffn.afd_port + ffn_rank

    def ffn_servers(self) -> list[Server]:
        n = self.ffn.ranks
        if self.ffn.layout == "group":
            return [Server("ffn", 0, tuple(range(n)), self.ffn.http_port, self.ffn.resources.scaled(n))]
        return [Server("ffn", f, (f,), self.ffn.http_port + f, self.ffn.resources) for f in range(n)]

    def attention_servers(self) -> list[Server]:
        """Every attention slot (``max_ranks`` of them)."""
        return [Server("attention", a, (), self.attention.http_port + a, self.attention.resources)
                for a in range(self.attention.max_ranks)]  # fmt: skip

    def initial_slots(self, count: int | None = None) -> list[int]:
        """The slots started first: ``count`` (default attention.ranks) spread over the FFN
        ranks (slot 0 of each FFN rank, then slot 1 of each, ...)."""
        count = self.attention.ranks if count is None else count
        order = [f * self.per_ffn + j for j in range(self.per_ffn) for f in range(self.ffn.ranks)]
        return sorted(order[:count])

    @property
    def elastic(self) -> bool:
        """Spare attention slots (max_ranks > ranks): the FFN ranks must serve with some of
        their slots empty, and ``scale`` may start and stop slots."""
        return self.attention.max_ranks > self.attention.ranks

    @property
    def relayed(self) -> bool:
        """Whether the Ray launcher puts a relay between attention and FFN ranks: the
        connector rejoins a lost FFN rank through its control channel (gloo; nixl and nccl,
        whose data plane is set up again over the channel), so a moved FFN rank is reached
        again."""
        return bool(self.ray.get("relay", True)) and _spec(self.connector).rejoin == "yes"

    def afd_config(self, server: Server, host: str, ffn_addresses: list[str]) -> dict[str, Any]:
        """The ``--afd-config`` of ``server``: ``host`` is where an FFN server listens
        (ignored by attention ranks), ``ffn_addresses`` one "host:port" per FFN rank."""
        cfg: dict[str, Any] = {
            "role": server.role,
            "connector": self.connector,
            "host": host,
            "port": self.ffn.afd_port,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "ffn_addresses": list(ffn_addresses),
            **self.afd,
        }
        if server.role == "attention" or self.ffn.layout == "replicas":
            cfg["rank"] = server.index
        if server.role == "ffn" and self.elastic:
            extra = dict(cfg.get("connector_extra_config") or {})
            extra[ELASTIC_KEY] = True
            cfg["connector_extra_config"] = extra
        return cfg

    def serve_args(self, server: Server) -> list[str]:
        """``vllm serve`` arguments after the model, host and port, and --afd-config."""
        role = self.attention if server.role == "attention" else self.ffn
        args = list(role.serve_args)
        if server.role == "ffn" and self.ffn.layout == "group":
            args += ["--tensor-parallel-size", str(self.ffn.ranks)]
        return args

    def command(self, server: Server, host: str, bind: str, ffn_addresses: list[str],
                python: str = "python") -> list[str]:  # fmt: skip
        """The argv of ``server``'s ``vllm serve`` (HTTP on ``bind``; an FFN server's AFD
        listener on ``host``)."""
        cfg = self.afd_config(server, host, ffn_addresses)
        return [python, "-m", "vllm.entrypoints.cli.main", "serve", self.model, "--host", bind,
                "--port", str(server.http_port), "--afd-config", json.dumps(cfg, sort_keys=True),
                *self.serve_args(server)]  # fmt: skip

    def server_env(self, server: Server) -> dict[str, str]:
        role = self.attention if server.role == "attention" else self.ffn
        return {**self.env, **role.env}


# ---------------------------------------------------------------- loading
def load(path: str | Path) -> Topology:
    """Read and validate a topology file (``.json``; ``.yaml``/``.yml`` with PyYAML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TopologyError(f"{path}: cannot read the topology file: {e}") from e
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise TopologyError(
                f"{path}: a YAML topology needs PyYAML (pip install pyyaml); or write it as JSON"
            ) from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise TopologyError(f"{path}: not valid YAML: {e}") from e
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise TopologyError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    return validate(raw, source=str(path))


def validate(raw: Any, source: str = "topology") -> Topology:
    """The Topology of ``raw`` (a parsed file); raises TopologyError naming the field."""

    def fail(where: str, msg: str):
        raise TopologyError(f"{source}: {where}: {msg}")

    _object(raw, "the topology", fail)
    _known(raw, TOP_KEYS, "the topology", fail)
    for key in ("name", "model", "attention", "ffn"):
        if key not in raw:
            fail(key, "is required")
    name = raw["name"]
    if not isinstance(name, str) or not NAME_RE.match(name):
        fail("name", f"must be a DNS label of at most 40 characters ([a-z][-a-z0-9]*); got {name!r}")
    model = _string(raw["model"], "model", fail)
    connector = _connector(raw.get("connector", "gloo"), fail)
    placement = raw.get("placement", "multi_host")
    if placement not in PLACEMENTS:
        fail("placement", f"must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    spec = _spec(connector)
    if placement == "multi_host" and not spec.cross_host:
        fail("connector", f"{connector!r} moves activations between the GPUs of one host and "
                          "cannot cross hosts; this topology's placement is multi_host (the "
                          "default): set \"placement\": \"one_host\", or use connector gloo, "
                          "nccl or a connector that crosses hosts")  # fmt: skip
    afd = raw.get("afd", {})
    _object(afd, "afd", fail)
    _known(afd, AFD_KEYS, "afd", fail)
    env = _env(raw.get("env", {}), "env", fail)
    image = raw.get("image")
    if image is not None:
        _string(image, "image", fail)
    secret = raw.get("secret", {})
    _object(secret, "secret", fail)
    _known(secret, SECRET_KEYS, "secret", fail)
    secret = {"name": f"{name}-afd-secret", "key": "secret", **secret}
    for k, v in secret.items():
        _string(v, f"secret.{k}", fail)
    ray = raw.get("ray", {})
    _object(ray, "ray", fail)
    _known(ray, RAY_KEYS, "ray", fail)
    ray = {"namespace": f"afd-{name}", "start_timeout_s": 600.0, "drain_timeout_s": 120.0,
           "relay": True, "health_period_s": 1.0, "log_dir": f"/tmp/afd-deploy/{name}",
           "internal_port_base": None, **ray}  # fmt: skip
    _string(ray["log_dir"], "ray.log_dir", fail)
    if ray["internal_port_base"] is not None:
        _port(ray["internal_port_base"], "ray.internal_port_base", fail)
    _string(ray["namespace"], "ray.namespace", fail)
    for key in ("start_timeout_s", "drain_timeout_s", "health_period_s"):
        _number(ray[key], f"ray.{key}", fail, positive=True)
    if not isinstance(ray["relay"], bool):
        fail("ray.relay", f"must be true or false; got {ray['relay']!r}")

    attention = _role("attention", raw["attention"], fail)
    ffn = _role("ffn", raw["ffn"], fail)
    _check_counts(attention, ffn, spec, afd, fail)
    _check_ports(attention, ffn, connector, fail)
    topo = Topology(name, model, connector, placement, dict(afd), env, image, secret,
                    attention, ffn, ray)  # fmt: skip
    _check_afd_configs(topo, fail)
    return topo


def _object(value: Any, where: str, fail) -> None:
    if not isinstance(value, dict):
        fail(where, f"must be an object; got {type(value).__name__}")


def _known(obj: dict, keys: tuple[str, ...], where: str, fail) -> None:
    unknown = sorted(set(obj) - set(keys))
    if unknown:
        fail(where, f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(keys)}")


def _string(value: Any, where: str, fail) -> str:
    if not isinstance(value, str) or not value.strip():
        fail(where, f"must be a non-empty string; got {value!r}")
    return value


def _int(value: Any, where: str, fail, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fail(where, f"must be an integer >= {minimum}; got {value!r}")
    return value


def _number(value: Any, where: str, fail, positive: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not ok or (positive and not value > 0) or value < 0:
        fail(where, f"must be a {'positive' if positive else 'non-negative'} number; got {value!r}")
    return float(value)


def _port(value: Any, where: str, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        fail(where, f"must be a port number in 1..65535; got {value!r}")
    return value


def _env(value: Any, where: str, fail) -> dict[str, str]:
    _object(value, where, fail)
    for k, v in value.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k) or not isinstance(v, str):
            fail(f"{where}.{k}", "must be a variable name with a string value")
        if k == "VLLM_AFD_SECRET":
            fail(f"{where}.{k}", "the AFD secret is not written into a topology: the launcher "
                                 "passes $VLLM_AFD_SECRET from its own environment (Ray) or "
                                 "from the Secret named by `secret` (Kubernetes)")  # fmt: skip
    return dict(value)


def _connector(value: Any, fail) -> str:
    from vllm.afd import connector_spec

    if not isinstance(value, str):
        fail("connector", f"must be a string; got {value!r}")
    try:
        return connector_spec.resolve(value).name
    except ValueError as e:
        fail("connector", str(e))


def _spec(connector: str):
    from vllm.afd import connector_spec

    return connector_spec.resolve(connector)


def _resources(raw: Any, where: str, fail) -> Resources:
    if raw is None:
        fail(where, "is required: what one rank needs (gpus, cpus; node_labels or "
                    "ray_resources to place it)")  # fmt: skip
    _object(raw, where, fail)
    _known(raw, RESOURCE_KEYS, where, fail)
    if "gpus" not in raw and "cpus" not in raw:
        fail(where, "names neither gpus nor cpus: say what one rank needs")
    gpus = _int(raw.get("gpus", 0), f"{where}.gpus", fail, 0)
    cpus = _number(raw.get("cpus", 1), f"{where}.cpus", fail, positive=True)
    memory = raw.get("memory")
    if memory is not None and not re.match(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$",
                                           str(memory)):  # fmt: skip
        fail(f"{where}.memory", f"must be a Kubernetes quantity such as \"16Gi\"; got {memory!r}")
    ray_resources = raw.get("ray_resources", {})
    _object(ray_resources, f"{where}.ray_resources", fail)
    for k, v in ray_resources.items():
        if k in ("CPU", "GPU", "memory"):
            fail(f"{where}.ray_resources.{k}", "is set by cpus/gpus/memory, not here")
        _number(v, f"{where}.ray_resources.{k}", fail, positive=True)
    labels = raw.get("node_labels", {})
    _object(labels, f"{where}.node_labels", fail)
    for k, v in labels.items():
        if not LABEL_RE.match(k) or not isinstance(v, str):
            fail(f"{where}.node_labels.{k}", "must be a label key with a string value")
    return Resources(gpus, cpus, None if memory is None else str(memory),
                     {k: float(v) for k, v in ray_resources.items()}, dict(labels))  # fmt: skip


def _role(name: str, raw: Any, fail) -> Role:
    _object(raw, name, fail)
    _known(raw, ROLE_KEYS[name], name, fail)
    ranks = _int(raw.get("ranks", 1), f"{name}.ranks", fail, 1)
    args = raw.get("serve_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        fail(f"{name}.serve_args", "must be a list of strings (the `vllm serve` flags)")
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in RESERVED_FLAGS or (flag == "--tensor-parallel-size" and name == "ffn") \
                or (flag in ("--tensor-parallel-size", "-tp") and name == "attention"):
            fail(f"{name}.serve_args", f"{flag} is set by the launcher (host, ports, "
                                       "--afd-config, an FFN group's --tensor-parallel-size); "
                                       "drop it")  # fmt: skip
        if flag == "--additional-config" or flag.startswith("--afd"):
            fail(f"{name}.serve_args", f"{flag}: AFD keys go into the topology's `afd` section")
    resources = _resources(raw.get("resources"), f"{name}.resources", fail)
    default_http = 8000 if name == "attention" else 8100
    http_port = _port(raw.get("http_port", default_http), f"{name}.http_port", fail)
    env = _env(raw.get("env", {}), f"{name}.env", fail)
    if name == "attention":
        max_ranks = _int(raw.get("max_ranks", ranks), "attention.max_ranks", fail, 1)
        if max_ranks < ranks:
            fail("attention.max_ranks", f"({max_ranks}) must be >= attention.ranks ({ranks}): "
                                        "it is the number of attention slots")  # fmt: skip
        return Role(name, ranks, tuple(args), resources, http_port, env, max_ranks=max_ranks)
    layout = raw.get("layout", "replicas")
    if layout not in LAYOUTS:
        fail("ffn.layout", f"must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    afd_port = _port(raw.get("afd_port", 29600), "ffn.afd_port", fail)
    return Role(name, ranks, tuple(args), resources, http_port, env, layout=layout,
                afd_port=afd_port)  # fmt: skip


def _check_counts(attention: Role, ffn: Role, spec, afd: dict, fail) -> None:
    m, n = attention.max_ranks, ffn.ranks
    if m < n or m % n:
        fail("attention.max_ranks", f"({m}) must be a multiple of ffn.ranks ({n}) and at least "
                                    "it: every FFN rank serves the same number of attention "
                                    "slots")  # fmt: skip
    if spec.max_ffn_ranks is not None and n > spec.max_ffn_ranks:
        fail("ffn.ranks", f"connector {spec.name!r} serves at most {spec.max_ffn_ranks} FFN "
                          f"rank(s); got {n}")  # fmt: skip
    if ffn.layout == "group":
        if n < 2:
            fail("ffn.layout", "a group runs ffn.ranks >= 2 FFN ranks in one server; with one "
                               "FFN rank use layout replicas")  # fmt: skip
        if not spec.ffn_group:
            fail("ffn.layout", f"connector {spec.name!r} does not serve an FFN group")
        extra = afd.get("connector_extra_config") or {}
        if isinstance(extra, dict) and extra.get("ffn_failover"):
            fail("afd.connector_extra_config.ffn_failover",
                 "needs FFN replicas (ffn.layout replicas): a group's ranks split the experts")
    if attention.ranks < n:
        fail("attention.ranks", f"({attention.ranks}) must be at least ffn.ranks ({n}): an FFN "
                                "rank without an attention rank never starts serving")  # fmt: skip


def _check_ports(attention: Role, ffn: Role, connector: str, fail) -> None:
    afd_span = ffn.ranks * (2 if connector == "nccl" else 1)  # nccl: its store at port + 1
    ranges = {
        "attention.http_port": (attention.http_port, attention.max_ranks),
        "ffn.http_port": (ffn.http_port, 1 if ffn.layout == "group" else ffn.ranks),
        "ffn.afd_port": (ffn.afd_port, afd_span),
    }
    for key, (lo, count) in ranges.items():
        if lo + count - 1 > 65535:
            fail(key, f"{lo}..{lo + count - 1} exceeds 65535")
    items = list(ranges.items())
    for i, (ka, (la, ca)) in enumerate(items):
        for kb, (lb, cb) in items[i + 1:]:
            if la < lb + cb and lb < la + ca:
                fail(kb, f"ports {lb}..{lb + cb - 1} overlap {ka}'s {la}..{la + ca - 1} (each "
                         "rank takes the base port + its rank)")  # fmt: skip


def _check_afd_configs(topo: Topology, fail) -> None:
    """Every derived --afd-config passes vllm.config.afd's own validation."""
    from vllm.config.afd import AFDConfig, AFDConfigError

    addresses = [f"ffn-{f}.example:{topo.afd_port(f)}" for f in range(topo.num_ffn_ranks)]
    for server in (*topo.ffn_servers(), *topo.attention_servers()):
        try:
            AFDConfig.from_dict(topo.afd_config(server, "0.0.0.0", addresses),
                                source=f"{server.name}'s --afd-config")  # fmt: skip
        except AFDConfigError as e:
            fail("afd", str(e))
