# SPDX-License-Identifier: Apache-2.0
"""AFD connector interface and registry.

A connector moves activations between attention ranks and FFN ranks. The
attention side holds an :class:`AttentionConnector` (one FFN peer); the FFN
side holds an :class:`FFNConnector` (its M/N attention peers). Control
messages are fixed-size (see ``vllm.afd.protocol``); data sizes are agreed
from them, so nothing is ever received into a buffer of unknown size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.afd.protocol import Control
from vllm.config.afd import DBO_CONNECTORS, GRAPH_CAPABLE_CONNECTORS, AFDConfig


@dataclass
class ConnectorContext:
    config: AFDConfig
    rank: int  # index of this process among the ranks of its role
    fingerprint: dict
    max_num_tokens: int
    device: torch.device
    # Width of the router logits sent with each layer when the gate runs on
    # the attention role (sizes device-side inboxes).
    num_router_logits: int | None = None


class AttentionConnector(ABC):
    # True when begin_step/send/recv are device work only (capturable in CUDA
    # graphs, see vllm.config.afd.GRAPH_CAPABLE_CONNECTORS).
    graph_capable = False
    # True when the connector serves micro-batched (DBO) steps: recv_start on this
    # side, recv_control on the FFN side (vllm.config.afd.DBO_CONNECTORS).
    dbo_capable = False

    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx

    @abstractmethod
    def connect(self) -> None:
        """Reach the FFN rank and handshake; raise within timeout_s."""

    @abstractmethod
    def begin_step(self, step_id: int, num_tokens: int) -> None:
        """Send the step-control message of one forward pass."""

    @abstractmethod
    def send(self, x: torch.Tensor) -> None:
        """Send one layer's FFN input (contiguous [num_tokens, width])."""

    @abstractmethod
    def recv(self, out: torch.Tensor) -> torch.Tensor:
        """Receive one layer's FFN output into ``out`` and return it."""

    @abstractmethod
    def end_step(self) -> None:
        """The forward pass has received its last layer."""

    @abstractmethod
    def close(self) -> None:
        """Say goodbye (clean stop) and release resources."""

    def is_up(self) -> bool:
        """The FFN peer is connected and has not failed."""
        return True

    def profile(self, is_start: bool) -> None:
        """Ask the FFN rank to start/stop its torch profiler (between steps)."""
        raise NotImplementedError(
            f"the AFD connector {self.ctx.config.connector!r} cannot drive the FFN profiler"
        )


@dataclass
class StepPeer:
    """One attention rank taking part in an FFN step."""

    rank: int
    control: Control


class FFNConnector(ABC):
    graph_capable = False
    dbo_capable = False
    generation = 0  # see IPCFFNConnector.generation

    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx

    @abstractmethod
    def start(self) -> None:
        """Bind and start accepting attention ranks."""

    @abstractmethod
    def wait_step(self, timeout: float) -> list[StepPeer]:
        """Attention ranks whose step-control message has arrived (may be
        empty after ``timeout``). Raises on a dead or silent peer."""

    @abstractmethod
    def recv(self, peer: StepPeer, out: torch.Tensor) -> None:
        """Receive this peer's layer input into ``out``."""

    @abstractmethod
    def send(self, peer: StepPeer, y: torch.Tensor) -> None:
        """Send this peer's layer output."""

    @abstractmethod
    def close(self) -> None: ...

    def take_profile_requests(self) -> list[bool]:
        """Profiler start (True) / stop (False) requests received since the
        last call, oldest first."""
        return []

    def peer_states(self) -> dict[str, bool]:
        """Attention ranks this FFN rank serves: connected or not."""
        return {}


_ATTENTION: dict[str, Callable[[ConnectorContext], AttentionConnector]] = {}
_FFN: dict[str, Callable[[ConnectorContext], FFNConnector]] = {}


def register_connector(
    name: str,
    attention_cls: Callable[[ConnectorContext], AttentionConnector],
    ffn_cls: Callable[[ConnectorContext], FFNConnector],
) -> None:
    # The config layer (which imports no connector) decides from
    # GRAPH_CAPABLE_CONNECTORS whether the attention role may keep CUDA graphs and
    # from DBO_CONNECTORS whether it may micro-batch; the roles read the classes'
    # graph_capable / dbo_capable. Refuse a registration where the two disagree
    # instead of letting one side run steps the other cannot serve.
    for attr, names, listing in (
        ("graph_capable", GRAPH_CAPABLE_CONNECTORS, "GRAPH_CAPABLE_CONNECTORS"),
        ("dbo_capable", DBO_CONNECTORS, "DBO_CONNECTORS"),
    ):
        listed = name in names
        for cls in (attention_cls, ffn_cls):
            has = bool(getattr(cls, attr, False))
            if has != listed:
                raise ValueError(
                    f"AFD connector {name!r}: {getattr(cls, '__name__', cls)}.{attr}="
                    f"{has} but {name!r} is {'' if listed else 'not '}in "
                    f"vllm.config.afd.{listing}"
                )
    _ATTENTION[name] = attention_cls
    _FFN[name] = ffn_cls


def _ensure_builtin() -> None:
    if "gloo" not in _ATTENTION:
        from vllm.distributed.afd import tcp  # noqa: F401  (registers itself)
    if "nccl" not in _ATTENTION:
        from vllm.distributed.afd import nccl  # noqa: F401
    if "cuda_ipc" not in _ATTENTION:
        from vllm.distributed.afd import cuda_ipc  # noqa: F401


def create_attention_connector(ctx: ConnectorContext) -> AttentionConnector:
    _ensure_builtin()
    try:
        cls = _ATTENTION[ctx.config.connector]
    except KeyError:
        raise ValueError(
            f"no AFD connector named {ctx.config.connector!r} "
            f"(available: {', '.join(sorted(_ATTENTION))})"
        ) from None
    return cls(ctx)


def create_ffn_connector(ctx: ConnectorContext) -> FFNConnector:
    _ensure_builtin()
    try:
        cls = _FFN[ctx.config.connector]
    except KeyError:
        raise ValueError(
            f"no AFD connector named {ctx.config.connector!r} "
            f"(available: {', '.join(sorted(_ATTENTION))})"
        ) from None
    return cls(ctx)
