# SPDX-License-Identifier: Apache-2.0
"""AFD connector interface and registry.

A connector moves activations between attention ranks and FFN ranks. The
attention side holds an :class:`AttentionConnector` (one FFN peer); the FFN
side holds an :class:`FFNConnector` (its M/N attention peers). Control
messages are fixed-size (see ``vllm.afd.protocol``); data sizes are agreed
from them, so nothing is ever received into a buffer of unknown size.

The classes below declare everything the roles call (``vllm.afd.attention``,
``vllm.afd.dbo``, ``vllm.afd.ffn_runner``, ``vllm.afd.rejoin``). Connectors are registered by name
and module path and imported on first use (:func:`create_connector`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm.afd import connector_spec
from vllm.afd.protocol import Control
from vllm.config.afd import AFDConfig


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
    # graphs; the connector's spec record, vllm.afd.connector_spec, says the same).
    graph_capable = False
    # True when the connector serves micro-batched (DBO) steps: recv_start on this
    # side, recv_control on the FFN side (the spec record's dbo_devices).
    dbo_capable = False
    # True when reconnect() can bring a lost FFN rank back and a step can then be
    # re-run from its first layer (vllm.afd.rejoin); else a lost FFN rank ends the
    # engine whatever rejoin_timeout_s says.
    can_rejoin = False
    # True when a forward during which the FFN rank was lost is re-run whole once the rank
    # is back (cuda_ipc with connector_extra_config.ipc_rejoin: a CUDA graph cannot re-run
    # half a step); vllm.afd.rejoin.run_forward then guards every model forward, and sets
    # forwards_guarded while it does.
    reruns_forward = False
    forwards_guarded = False
    # With reruns_forward: every forward is waited for and checked (step_lost) even where
    # a loss is not held (a host thread of this process serves the pass's exchanges,
    # nixl's proxy: nothing else may block on the pass meanwhile).
    checks_every_forward = False
    # The FFN rank this attention rank exchanges with (another one after a failover).
    ffn_rank = 0

    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx

    @abstractmethod
    def connect(self) -> None:
        """Reach the FFN rank and handshake; raise within timeout_s."""

    def reconnect(self, deadline: float) -> None:
        """After a lost FFN rank (an AFDPeerError of a step, or of a heartbeat): reach
        it again at its address, re-handshake (the same fingerprint), and take the new
        connection; no-op while up. Retries with backoff until ``deadline``
        (time.monotonic()), then raises AFDPeerError; raises AFDHandshakeError at once
        for a peer of another deployment. Connectors with ``can_rejoin`` implement it."""
        raise NotImplementedError(
            f"the AFD connector {self.ctx.config.connector!r} cannot rejoin a lost FFN rank"
        )

    def lost_at(self) -> float | None:
        """time.monotonic() when the FFN rank was found lost; None while connected."""
        return None

    def holds_losses(self) -> bool:
        """A loss of the FFN rank is held for a re-run of the forward instead of ending
        the rank (``reruns_forward`` connectors, once the forwards are guarded)."""
        return False

    def step_lost(self) -> str | None:
        """After a forward (its device work waited for): why the FFN rank was lost during
        it, None when the pass was clean. Connectors with ``reruns_forward`` implement it."""
        return None

    @abstractmethod
    def begin_step(
        self,
        step_id: int,
        num_tokens: int,
        ubatch: tuple[int, int] | None = None,
        ubatch_tokens: list[int] | None = None,
    ) -> None:
        """Send the step-control message of one forward pass. ``ubatch``:
        (index, count) when this opens micro-batch ``index`` of a DBO step (the
        micro-batches of a step share ``step_id``); ``ubatch_tokens``: the token
        counts of all micro-batches of the step (for connectors that announce
        them up front). Step ids grow from step to step."""

    @abstractmethod
    def send(self, x: torch.Tensor) -> None:
        """Send one layer's FFN input (contiguous [num_tokens, width])."""

    @abstractmethod
    def recv(self, out: torch.Tensor) -> torch.Tensor:
        """Receive one layer's FFN output into ``out`` and return it."""

    def recv_start(self, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """DBO: start receiving one layer's FFN output into ``out``; the returned
        ``wait()`` gives it. Connectors with ``dbo_capable = True`` implement it."""
        raise NotImplementedError(
            f"the AFD connector {self.ctx.config.connector!r} does not serve micro-batched "
            "(DBO) steps"
        )

    @abstractmethod
    def end_step(self) -> None:
        """The forward pass has received its last layer."""

    @abstractmethod
    def close(self) -> None:
        """Say goodbye (clean stop) and release resources."""

    def is_up(self) -> bool:
        """The FFN peer is connected and has not failed."""
        return True

    def shares_device(self) -> bool | None:
        """True when the FFN rank computes on this rank's own GPU (two processes on one
        device share its SMs and memory bandwidth), False when on another device, None
        when the connector cannot tell."""
        return None

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
    # The connection (session) of the rank the step came on: a step never reaches
    # a later session of the same rank (after a loss and a new handshake).
    session: object = field(default=None, repr=False, compare=False)


class FFNConnector(ABC):
    graph_capable = False
    dbo_capable = False
    # True when micro-batch 0's control message announces every micro-batch of
    # a DBO step, so recv_control answers without waiting (cuda_ipc).
    ubatch_controls_upfront = False
    # Bumped whenever an attention rank (re)joins with new device buffers:
    # graphs captured before hold the previous session's addresses.
    generation = 0
    # True when the loss of an attention rank (EOF, reset, silence, a protocol
    # error) ends that rank's session only: the connector forgets it, serves the
    # other ranks on, and takes the rank again on a new handshake (its server
    # restarted). False: a lost attention rank ends the FFN rank (wait_step, or
    # the runner on a failed step, raises).
    survives_peer_loss = False
    # True when the FFN rank posts its receives and sends (post_recv, post_control,
    # post_send) and moves the bytes of all its attention ranks at once (pump, arrived,
    # take): the runner then runs a layer for the ranks whose inputs arrived and never
    # waits on one rank's bytes for another. False: recv and send wait (or queue device
    # work) one rank after another.
    async_io = False

    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx

    @abstractmethod
    def start(self) -> None:
        """Bind and start accepting attention ranks."""

    @abstractmethod
    def wait_step(self, timeout: float) -> list[StepPeer]:
        """Attention ranks whose step-control message has arrived (may be
        empty after ``timeout``). Raises on a dead or silent peer."""

    def recv_control(self, peer: StepPeer) -> Control:
        """DBO: the control message of the next micro-batch of the step ``peer``
        opened. Connectors with ``dbo_capable = True`` implement it."""
        raise NotImplementedError(
            f"the AFD connector {self.ctx.config.connector!r} does not serve micro-batched "
            "(DBO) steps"
        )

    @abstractmethod
    def recv(self, peer: StepPeer, out: torch.Tensor) -> None:
        """Receive this peer's layer input into ``out``."""

    @abstractmethod
    def send(self, peer: StepPeer, y: torch.Tensor) -> None:
        """Send this peer's layer output."""

    @abstractmethod
    def close(self) -> None: ...

    # -- async_io connectors -------------------------------------------------
    def post_recv(self, peer: StepPeer, out: torch.Tensor) -> None:
        """Receive this peer's next layer input into ``out`` as its bytes arrive."""
        raise NotImplementedError(self._no_async_io())

    def post_control(self, peer: StepPeer) -> None:
        """Receive the control message of this peer's next micro-batch (DBO)."""
        raise NotImplementedError(self._no_async_io())

    def arrived(self, peer: StepPeer) -> bool:
        """Every message posted for this peer has arrived; AFDPeerError when its
        session is gone."""
        raise NotImplementedError(self._no_async_io())

    def take(self, peer: StepPeer) -> list[Control]:
        """Finish the arrived messages of this peer; the control messages among them."""
        raise NotImplementedError(self._no_async_io())

    def post_send(self, peer: StepPeer, y: torch.Tensor) -> None:
        """Send this peer's layer output without waiting for the peer to take it."""
        raise NotImplementedError(self._no_async_io())

    def pump(self, timeout: float) -> bool:
        """Move the bytes of every attention rank, waiting up to ``timeout`` for any;
        True when a posted message arrived or a rank with one was lost."""
        raise NotImplementedError(self._no_async_io())

    def _no_async_io(self) -> str:
        return f"the AFD connector {self.ctx.config.connector!r} has no posted I/O (async_io)"

    def drop_peer(self, peer: StepPeer, why: str) -> None:
        """A step of ``peer`` failed (``why``: an AFDPeerError of recv, send or
        recv_control): end that rank's session (its connection is closed; the
        rank may handshake again). The runner then finishes the step for the other
        ranks. Connectors with ``survives_peer_loss = True`` implement it."""
        raise NotImplementedError(
            f"the AFD connector {self.ctx.config.connector!r} cannot drop one attention rank"
        )

    def take_profile_requests(self) -> list[bool]:
        """Profiler start (True) / stop (False) requests received since the
        last call, oldest first."""
        return []

    def peer_states(self) -> dict[str, bool]:
        """Attention ranks this FFN rank serves: connected or not."""
        return {}


ROLES = ("attention", "ffn")

# name -> (attention class, FFN class), checked against the connector's spec record.
_LOADED: dict[str, tuple[type, type]] = {}


def register_connector(
    name: str,
    attention_cls: Callable[[ConnectorContext], AttentionConnector],
    ffn_cls: Callable[[ConnectorContext], FFNConnector],
) -> None:
    """Register the classes of connector ``name`` (a connector module calls this for
    itself when it is imported); its spec record must exist and agree with them."""
    spec = connector_spec.resolve(name)
    check_capabilities(spec, attention_cls, ffn_cls)
    _LOADED[spec.name] = (attention_cls, ffn_cls)


def check_capabilities(spec: connector_spec.ConnectorSpec, attention_cls, ffn_cls) -> None:
    """The config layer (which imports no connector) decides from the spec record whether
    the attention role may keep CUDA graphs or micro-batch; the roles read the classes'
    graph_capable / dbo_capable. Refuse classes that disagree with their record instead of
    letting one side run steps the other cannot serve."""
    for attr, declared, classes in (
        ("graph_capable", spec.graph_capable, (attention_cls,)),
        ("graph_capable", spec.ffn_graph_capable, (ffn_cls,)),
        ("dbo_capable", spec.dbo_capable, (attention_cls, ffn_cls)),
    ):
        for cls in classes:
            has = bool(getattr(cls, attr, False))
            if has != declared:
                raise ValueError(
                    f"AFD connector {spec.name!r}: {getattr(cls, '__name__', cls)}.{attr}="
                    f"{has} but its spec record (vllm.afd.connector_spec) says {declared}"
                )


def connector_names() -> list[str]:
    return sorted(s.name for s in connector_spec.all_specs())


def connector_classes(name: str) -> tuple[type, type]:
    """(attention class, FFN class) of connector ``name`` (a name, an alias or a module
    path), importing its module on first use."""
    spec = connector_spec.resolve(name)
    if spec.name not in _LOADED:
        try:
            mod = importlib.import_module(spec.module)
        except ImportError as e:
            need = f" (it needs `pip install {spec.requires}`)" if spec.requires else ""
            raise ImportError(
                f"AFD connector {spec.name!r}: cannot import {spec.module}{need}: {e}"
            ) from e
        register_connector(
            spec.name, getattr(mod, spec.attention_class), getattr(mod, spec.ffn_class)
        )
    return _LOADED[spec.name]


def create_connector(ctx: ConnectorContext, role: str) -> AttentionConnector | FFNConnector:
    """The connector of ``ctx.config.connector`` for ``role`` ("attention" or "ffn")."""
    if role not in ROLES:
        raise ValueError(f"AFD connector role must be one of {ROLES}; got {role!r}")
    attention_cls, ffn_cls = connector_classes(ctx.config.connector)
    return (attention_cls if role == "attention" else ffn_cls)(ctx)


def create_attention_connector(ctx: ConnectorContext) -> AttentionConnector:
    return create_connector(ctx, "attention")


def create_ffn_connector(ctx: ConnectorContext) -> FFNConnector:
    return create_connector(ctx, "ffn")
