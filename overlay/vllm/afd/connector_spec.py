# SPDX-License-Identifier: Apache-2.0
"""One spec record per AFD connector: what it is, what it can do, what it takes.

Every fact about a connector that another part reads lives in its :class:`ConnectorSpec`:
configuration validation (``vllm.config.afd``: names and aliases, the devices, CUDA
graphs, DBO, failover, the FFN ranks it serves, the ``connector_extra_config`` keys with
their types and bounds), the registry (``vllm.distributed.afd.base``: the module and
classes, imported on first use, whose declared capabilities must agree with the record)
and the docs: the capability matrix of docs/connectors.md and the per-line matrix of
docs/status.md (``scripts/status_page.py``, checked by ``make check``). Capabilities are
declared here, never probed.

Pure Python (no torch, no vLLM import): it is read at argument-parse time.

A connector outside this package is named by module path: ``"connector":
"my_pkg.my_connector"`` imports ``my_pkg.my_connector`` and reads its
``AFD_CONNECTOR_SPEC`` (a :class:`ConnectorSpec`), as vLLM's KV connectors may be given
by module path.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any

# Kinds of connector_extra_config values.
BOOL, INT, NUMBER, STRING = "bool", "int", "number", "string"


@dataclass(frozen=True)
class ExtraKey:
    """One ``connector_extra_config`` key: its kind, default, bounds and meaning."""

    name: str
    kind: str
    default: Any
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    # STRING only: the values it may take (empty: any non-empty string).
    choices: tuple[str, ...] = ()

    def check(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable for this key, None when it is."""
        where = f"connector_extra_config.{self.name}"
        if self.kind == BOOL:
            if isinstance(value, bool):
                return None
            return f"{where} must be true or false; got {value!r}"
        if self.kind == STRING:
            if self.choices:
                if isinstance(value, str) and value in self.choices:
                    return None
                return f"{where} must be one of {_choices(self.choices)}; got {value!r}"
            if isinstance(value, str) and value.strip():
                return None
            return f"{where} must be a non-empty string; got {value!r}"
        kind = "an integer" if self.kind == INT else "a number"
        wanted = f"{where} must be {kind} in {_bounds(self.minimum, self.maximum)}; got {value!r}"
        number = int if self.kind == INT else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            return wanted
        if not math.isfinite(value):
            return wanted
        lo, hi = self.minimum, self.maximum
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            return wanted
        return None

    def describe(self) -> str:
        kind = {BOOL: "true/false", INT: "integer", NUMBER: "number", STRING: "string"}[self.kind]
        if self.kind in (INT, NUMBER) and (self.minimum is not None or self.maximum is not None):
            kind += " in " + _bounds(self.minimum, self.maximum)
        if self.choices:
            kind = "one of " + _choices(self.choices)
        default = "unset" if self.default is None else repr(self.default)
        return f"{kind}, default {default}"


def _choices(values: tuple[str, ...]) -> str:
    return ", ".join(map(repr, values))


def _bounds(lo: float | None, hi: float | None) -> str:
    def fmt(v: float | None, inf: str) -> str:
        return inf if v is None else str(v) if isinstance(v, int) else f"{v:g}"

    return f"{fmt(lo, '-inf')}..{fmt(hi, 'inf')}"


@dataclass(frozen=True)
class ConnectorSpec:
    """What a connector is and declares. ``dbo_devices``: the devices on which it serves
    micro-batched (DBO) steps; ``rejoin``: "yes", "no" or "opt-in" (an extra key turns it
    on); ``max_ffn_ranks``: None for no limit; ``max_ubatches``: micro-batches per step it
    has room for (None: no limit); ``cross_host``: attention and FFN ranks may sit on
    different hosts."""

    name: str
    module: str
    attention_class: str
    ffn_class: str
    summary: str
    devices: tuple[str, ...]
    cross_host: bool
    aliases: tuple[str, ...] = ()
    graph_capable: bool = False
    # The FFN side captures its passes in CUDA graphs too (None: as graph_capable); False
    # where the FFN rank's host loop takes part in each hand-over (nixl).
    ffn_graphs: bool | None = None
    dbo_devices: tuple[str, ...] = ()
    rejoin: str = "no"
    failover: bool = False
    ffn_group: bool = False
    max_ffn_ranks: int | None = None
    max_ubatches: int | None = None
    extra_keys: tuple[ExtraKey, ...] = ()
    # A Python package the connector needs beyond vLLM's own (named in the error).
    requires: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def dbo_capable(self) -> bool:
        return bool(self.dbo_devices)

    @property
    def ffn_graph_capable(self) -> bool:
        return self.graph_capable if self.ffn_graphs is None else self.ffn_graphs

    def keys(self) -> dict[str, ExtraKey]:
        """Every connector_extra_config key this connector takes (the channel's and its own)."""
        return {k.name: k for k in (*CHANNEL_KEYS, *self.extra_keys)}

    def check_extra(self, extra: dict[str, Any]) -> str | None:
        """Why ``extra`` (a connector_extra_config) is not acceptable, None when it is."""
        allowed = self.keys()
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            return (
                f"connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))} for "
                f"connector {self.name!r}; allowed: {', '.join(sorted(allowed))}"
            )
        for name, value in extra.items():
            if (why := allowed[name].check(value)) is not None:
                return why
        return None

    def value(self, extra: dict[str, Any], name: str) -> Any:
        """The value of key ``name`` in ``extra``, or its default."""
        return extra.get(name, self.keys()[name].default)


# connector_extra_config.ffn_schedule: how an FFN rank serves the attention ranks ready
# together (vllm.afd.ffn_runner; docs/ping-pong.md).
FFN_SCHEDULES = ("join", "pingpong", "auto")

# Keys of the control channel and the FFN serve loop: every connector takes them.
CHANNEL_KEYS: tuple[ExtraKey, ...] = (
    ExtraKey("secret_env", STRING, "VLLM_AFD_SECRET",
             "the environment variable holding the deployment's shared secret"),
    ExtraKey("batch_window_ms", NUMBER, 5.0,
             "how long an FFN rank waits for the other attention ranks of a pass (ms)",
             minimum=0, maximum=10_000),
    ExtraKey("ffn_max_tokens_per_pass", INT, None,
             "the most tokens of one FFN pass (default max_num_batched_tokens)",
             minimum=1, maximum=1 << 30),
    ExtraKey("early_step_control", BOOL, True,
             "send a step's control message before the forward's first layer"),
    ExtraKey("ffn_cuda_graphs", BOOL, True, "the FFN rank replays CUDA graphs of recurring steps"),
    ExtraKey("ffn_layer_graphs", BOOL, False,
             "with a data plane the FFN host drives (gloo, nixl) on a GPU: the FFN rank replays "
             "CUDA graphs of each layer's block at recurring token counts"),
    ExtraKey("ffn_cuda_graph_max_tokens", INT, None,
             "the largest step (tokens) the FFN rank captures", minimum=0, maximum=1 << 24),
    ExtraKey("ffn_cuda_graph_max_count", INT, 64,
             "the most CUDA graphs the FFN rank keeps", minimum=0, maximum=4096),
    ExtraKey("ffn_cuda_graph_window", INT, None,
             "a step shape is captured when it recurs within this many FFN passes",
             minimum=0, maximum=1 << 20),
    ExtraKey("ffn_schedule", STRING, "join",
             "how an FFN rank serves several ready attention ranks: one pass over all their "
             "tokens (join), their steps interleaved layer by layer (pingpong), or per "
             "composition of ranks whichever gave the shorter rounds (auto)",
             choices=FFN_SCHEDULES),
)

FAILOVER_KEY = ExtraKey(
    "ffn_failover", BOOL, False,
    "FFN replicas: an attention rank whose FFN rank is lost moves to another replica",
)

# On the control channel's FFN side (gloo, nixl): the FFN rank does not end when some of its
# attention ranks never join (slots a scaler starts later, vllm.afd.deploy).
ELASTIC_KEY = ExtraKey(
    "ffn_elastic_attention", BOOL, False,
    "FFN side: attention slots may stay empty (started later); no start-up wait for all",
)

SPECS: dict[str, ConnectorSpec] = {}


def register(spec: ConnectorSpec) -> ConnectorSpec:
    """Add ``spec`` (its name and aliases must be new)."""
    for name in (spec.name, *spec.aliases):
        owner = _owner(name.lower())
        if owner is not None and owner is not spec:
            raise ValueError(f"AFD connector name {name!r} is taken by {owner.name!r}")
    SPECS[spec.name] = spec
    return spec


def _owner(name: str) -> ConnectorSpec | None:
    for spec in SPECS.values():
        if name == spec.name.lower() or name in (a.lower() for a in spec.aliases):
            return spec
    return None


def resolve(name: str) -> ConnectorSpec:
    """The spec of connector ``name``: a registered name or alias (any case), or a module
    path whose module defines ``AFD_CONNECTOR_SPEC``. Raises ValueError naming the choices."""
    spec = _owner(name.lower())
    if spec is not None:
        return spec
    if "." in name:
        return _from_module(name)
    known = sorted(n for s in SPECS.values() for n in (s.name, *s.aliases))
    raise ValueError(
        f"unknown connector {name!r}; known: {', '.join(known)} (or a module path whose "
        "module defines AFD_CONNECTOR_SPEC)"
    )


def _from_module(path: str) -> ConnectorSpec:
    try:
        module = importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"connector module {path!r} cannot be imported: {e}") from e
    spec = getattr(module, "AFD_CONNECTOR_SPEC", None)
    if not isinstance(spec, ConnectorSpec):
        raise ValueError(
            f"connector module {path!r} defines no AFD_CONNECTOR_SPEC (a "
            "vllm.afd.connector_spec.ConnectorSpec)"
        )
    if spec.name in SPECS and SPECS[spec.name] is not spec:
        raise ValueError(f"connector module {path!r} declares the taken name {spec.name!r}")
    return register(spec)


def all_specs() -> list[ConnectorSpec]:
    return list(SPECS.values())


# ---------------------------------------------------------------- the connectors
register(ConnectorSpec(
    name="gloo",
    aliases=("tcp",),
    module="vllm.distributed.afd.tcp",
    attention_class="TCPAttentionConnector",
    ffn_class="TCPFFNConnector",
    summary="activations over the control channel's TCP socket (host memory)",
    devices=("cpu", "cuda"),
    cross_host=True,
    dbo_devices=("cpu",),
    rejoin="yes",
    failover=True,
    ffn_group=True,
    extra_keys=(FAILOVER_KEY, ELASTIC_KEY),
))

register(ConnectorSpec(
    name="cuda_ipc",
    aliases=("ipc",),
    module="vllm.distributed.afd.cuda_ipc",
    attention_class="IPCAttentionConnector",
    ffn_class="IPCFFNConnector",
    summary="device inboxes mapped by CUDA IPC; flags and copies on the current stream",
    devices=("cuda",),
    cross_host=False,
    graph_capable=True,
    dbo_devices=("cuda",),
    rejoin="opt-in",
    max_ubatches=2,
    extra_keys=(
        ExtraKey("ipc_rejoin", BOOL, False,
                 "a lost FFN rank is rejoined and the interrupted forward re-run whole"),
        ExtraKey("ffn_hot_poll", BOOL, True,
                 "the FFN rank polls its inbox flags without sleeping"),
    ),
))

register(ConnectorSpec(
    name="nccl",
    aliases=("p2pncclafdconnector",),
    module="vllm.distributed.afd.nccl",
    attention_class="NCCLAttentionConnector",
    ffn_class="NCCLFFNConnector",
    summary="activations and step control by NCCL point-to-point (PyNccl) on the current "
            "stream, one communicator per session formed over the channel",
    devices=("cuda",),
    cross_host=True,
    graph_capable=True,
    rejoin="yes",
))

register(ConnectorSpec(
    name="nixl",
    module="vllm.distributed.afd.nixl",
    attention_class="NixlAttentionConnector",
    ffn_class="NixlFFNConnector",
    summary="one-sided NIXL writes into registered inboxes (host or device memory), with "
            "notifications; on CUDA posted by a host proxy for the graphs",
    devices=("cpu", "cuda"),
    cross_host=True,
    graph_capable=True,
    ffn_graphs=False,
    dbo_devices=("cpu", "cuda"),
    rejoin="yes",
    failover=True,
    max_ubatches=2,
    requires="nixl",
    extra_keys=(
        FAILOVER_KEY,
        ELASTIC_KEY,
        ExtraKey("nixl_backend", STRING, "UCX",
                 "the NIXL backend that moves the activations (UCX: RDMA, TCP or shared memory)"),
        ExtraKey("nixl_spin_us", INT, 2000,
                 "how long a wait polls without sleeping (us); lower where the roles share cores",
                 minimum=0, maximum=1_000_000),
    ),
))
