# SPDX-License-Identifier: Apache-2.0
"""The attention role: the remote-FFN op and its connection to the FFN rank.

Per forward pass one fixed-size step-control message (step id, token count)
opens the step - at the start of the model's forward (a forward pre-hook,
``forward_pre_hook``), else at the first remote layer - and
:class:`AFDStepMetadata` is installed on the forward context; then every layer
sends its FFN input and waits for the FFN output. Dummy, profile and warm-up
passes go through the same path, so the FFN side mirrors them without any
special case.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from multiprocessing import util as mp_util

import torch
from torch.profiler import record_function

from vllm.afd import compat, dbo, failure, metrics, rejoin
from vllm.afd.protocol import AFDHandshakeError, AFDPeerError, AFDProtocolError
from vllm.afd.roles import EXIT_ROLE_CLOSE, afd_config
from vllm.afd.roles import (
    graph_capture_guard as graph_capture_guard,  # patch graph-capture-guard imports it here
)
from vllm.distributed.afd.base import ConnectorContext, create_attention_connector
from vllm.logger import init_logger

logger = init_logger(__name__)

# How long the close at the process's exit may take (its goodbye to the FFN rank): a lock
# held by a thread stuck in an exchange must not keep the process from ending.
CLOSE_AT_EXIT_S = 5.0


@dataclass
class AFDStepMetadata:
    step_id: int
    num_tokens: int


class AttentionClient:
    def __init__(self) -> None:
        self.layers: list[int] = []
        self.gated: dict[int, bool] = {}
        self.first = -1
        self.last = -1
        self.connector = None
        self.step_id = 0
        self.rank = 0
        self._transfer = self._wait = 0.0
        self._bytes_out = self._bytes_in = 0
        self.early_control = True  # connector_extra_config.early_step_control
        self._opened: int | None = None  # tokens of the step begin_forward opened

    def register(self, layer_idx: int, gated: bool = False) -> None:
        self.layers.append(layer_idx)
        self.gated[layer_idx] = gated
        self.first = min(self.layers)
        self.last = max(self.layers)

    def connect(self, vllm_config, fingerprint: dict, num_router_logits: int | None) -> None:
        """Reach the FFN rank. ``fingerprint``: what both roles must agree on (of
        the registered layers), ``num_router_logits``: the router width (see
        vllm.afd.model_split, which builds both)."""
        cfg = afd_config(vllm_config)
        if self.connector is not None:
            return
        rank = cfg.resolved_rank(vllm_config.parallel_config.data_parallel_rank)
        self.rank = rank
        ctx = ConnectorContext(
            config=cfg,
            rank=rank,
            fingerprint=fingerprint,
            max_num_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
            device=vllm_config.device_config.device,
            num_router_logits=num_router_logits,
        )
        connector = create_attention_connector(ctx)
        # A loss the connector gives up on between steps (the rejoin window passed while
        # idle) ends this process, as a lost peer in a step ends the engine.
        connector.on_failure = failure.exit_now
        metrics.STATS.start("attention", rank, self.peers)
        metrics.STATS.outage = self.outage_seconds
        try:
            connector.connect()
        except Exception:
            metrics.STATS.inc("handshake_failures")
            metrics.STATS.write()
            raise
        self.connector = connector
        self.early_control = cfg.connector_extra_config.get("early_step_control", True)
        # At the process's exit, in vLLM's engine core too (on a GPU host a forked
        # multiprocessing child: it ends with os._exit and runs no atexit hook, but
        # multiprocessing's exit hook); after the connector's last report (nixl's proxy).
        mp_util.Finalize(None, self._close_at_exit, exitpriority=EXIT_ROLE_CLOSE)
        dbo.watch_ubatch_threads(vllm_config, rank)
        dbo.configure(vllm_config, connector.shares_device())

    def exchange(
        self, x: torch.Tensor, layer_idx: int, router_logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        try:
            try:
                return self._exchange(x, layer_idx, router_logits)
            except AFDPeerError as e:
                if not rejoin.possible(self.connector, _ubatch()[1] > 0):
                    raise
                return self._resume(x, layer_idx, router_logits, e)
        except (AFDPeerError, AFDHandshakeError) as e:
            # For the error the clients of this server get (see vllm.afd.failure).
            failure.record("attention", self.rank, str(e))
            raise

    def _resume(
        self, x: torch.Tensor, layer_idx: int, router_logits: torch.Tensor | None,
        error: AFDPeerError,
    ) -> torch.Tensor:  # fmt: skip
        """The FFN rank was lost in this step: rejoin it and re-run the step's FFN
        exchanges up to this layer (vllm.afd.rejoin), then go on with the step."""
        before = [self.gated[i] for i in sorted(self.layers) if i < layer_idx]

        def rerun(conn) -> torch.Tensor:
            self.step_id += 1
            return rejoin.rerun_step(conn, self.step_id, before, x.contiguous(), router_logits)

        out = rejoin.resume(self.connector, rerun, error)
        if layer_idx == self.last:
            self.connector.end_step()
            self._record_step()
        return out

    def _exchange(
        self, x: torch.Tensor, layer_idx: int, router_logits: torch.Tensor | None
    ) -> torch.Tensor:
        conn = self.connector
        if conn is None:
            raise RuntimeError("AFD attention role: the FFN connection is not established")
        x = x.contiguous()
        t0 = time.perf_counter()
        # DBO: this thread runs micro-batch `ub` of `nub` (see vllm.afd.dbo).
        ub, nub = _ubatch()
        if layer_idx == self.first:
            self._open_step(conn, x.shape[0], ub, nub)
        with record_function("afd.send"):
            conn.send(x)
            sent = x.numel() * x.element_size()
            if router_logits is not None:
                # Router logits travel as float32 (exact for bf16/fp16/fp32 gates).
                logits = router_logits.to(torch.float32).contiguous()
                conn.send(logits)
                sent += logits.numel() * 4
        t1 = time.perf_counter()
        if nub:
            # The other micro-batch computes its attention while the FFN rank
            # serves this one; its turn ends at its own exchange. The reply is
            # received in the background meanwhile (see recv_start).
            wait = conn.recv_start(torch.empty_like(x))
            with record_function("afd.ubatch_yield"):
                _dbo_yield()
        t1w = time.perf_counter() if nub else t1
        with record_function("afd.ffn_wait"):
            out = wait() if nub else conn.recv(torch.empty_like(x))
        t2 = time.perf_counter()
        self._transfer += t1 - t0
        self._wait += t2 - t1w  # the other micro-batch's turn is not FFN wait
        self._bytes_out += sent
        self._bytes_in += out.numel() * out.element_size()
        if layer_idx == self.last and (not nub or ub == nub - 1):
            conn.end_step()
            # A captured pass only records work (the FFN rank counts replays).
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._record_step()
        return out

    def begin_forward(self, num_tokens: int) -> None:
        """The model's forward starts (a pre-hook, vllm.afd.model_split.post_load): open
        the step now rather than at the first remote layer, so that the FFN rank learns
        of it while this side still computes the embedding and the first layer's
        attention (with cuda_ipc the FFN host polls for the control message and
        launches its graph meanwhile; at the first layer that latency was on the
        step's path). Micro-batched steps open at the first layer as before, and so
        does a step whose opening fails here (a lost peer is handled there, where
        rejoining is)."""
        conn = self.connector
        self._opened = None  # a forward that ended before its first remote layer
        if conn is None or not self.early_control or _ubatch()[1]:
            return
        try:
            self._open_step(conn, num_tokens, 0, 0)
        except AFDPeerError:
            return
        logger.info_once("AFD attention role: steps open at the model's forward "
                         "(connector_extra_config.early_step_control)")  # fmt: skip
        self._opened = num_tokens

    def _open_step(self, conn, num_tokens: int, ub: int, nub: int) -> None:
        """Step control for a step of ``num_tokens`` tokens (micro-batch ``ub`` of
        ``nub``), unless begin_forward opened it already."""
        opened, self._opened = self._opened, None
        if opened is not None:
            if opened != num_tokens:
                raise AFDProtocolError(
                    f"AFD attention role: the model's forward opened a step of {opened} "
                    f"tokens, its first remote FFN layer has {num_tokens}; set "
                    "connector_extra_config.early_step_control to false for this model"
                )
            return
        if ub == 0:
            self.step_id += 1
            self._transfer = self._wait = 0.0
            self._bytes_out = self._bytes_in = 0
        if nub:
            conn.begin_step(
                self.step_id, num_tokens, ubatch=(ub, nub),
                ubatch_tokens=dbo.step_ubatch_tokens(),
            )  # fmt: skip
        else:
            conn.begin_step(self.step_id, num_tokens)
        _install_step_metadata(AFDStepMetadata(self.step_id, num_tokens))

    def _record_step(self) -> None:
        metrics.STATS.record(
            {"steps": 1, "layer_exchanges": len(self.layers),
             "bytes_sent": self._bytes_out, "bytes_received": self._bytes_in},
            {"step_transfer_seconds": self._transfer, "step_ffn_wait_seconds": self._wait},
        )

    def peers(self) -> dict[str, bool]:
        conn = self.connector
        name = f"ffn_rank_{conn.ffn_rank}" if conn is not None else "ffn"
        return {name: conn is not None and conn.is_up()}

    def outage_seconds(self) -> float:
        """Seconds since the FFN rank was found lost (0 while it is connected)."""
        lost = self.connector.lost_at() if self.connector is not None else None
        return 0.0 if lost is None else time.monotonic() - lost

    def profile(self, is_start: bool) -> None:
        """Start/stop the torch profiler of the FFN rank (vLLM's /start_profile
        and /stop_profile on the attention server call this)."""
        if self.connector is not None:
            self.connector.profile(is_start)

    def _close_at_exit(self) -> None:
        closing = threading.Thread(target=self.close, name="afd-close", daemon=True)
        closing.start()
        closing.join(CLOSE_AT_EXIT_S)
        if closing.is_alive():
            logger.warning(
                "AFD attention rank %s: the connection to the FFN rank did not close within "
                "%.0f s of the process's exit; exiting without its goodbye (the FFN rank sees "
                "a lost peer)", self.rank, CLOSE_AT_EXIT_S,
            )  # fmt: skip

    def close(self) -> None:
        if self.connector is not None:
            try:
                self.connector.close()
            finally:
                self.connector = None


def _ubatch() -> tuple[int, int]:
    """(index, count) of the micro-batch this thread runs; (0, 0) outside DBO."""
    return dbo.current_ubatch()


def _dbo_yield() -> None:
    compat.yield_turn()


def _install_step_metadata(meta: AFDStepMetadata) -> None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if is_forward_context_available():
        get_forward_context().additional_kwargs["afd"] = meta


CLIENT = AttentionClient()


def register_remote_layer(layer_idx: int, gated: bool = False) -> None:
    _register_op()
    CLIENT.register(layer_idx, gated)


def connect(vllm_config, fingerprint: dict, num_router_logits: int | None) -> None:
    CLIENT.connect(vllm_config, fingerprint, num_router_logits)


_FORWARD_ARGS = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")


def open_steps_at_forward(model: torch.nn.Module) -> None:
    """Put forward_pre_hook on the model once (vllm.afd.model_split.post_load)."""
    if getattr(model, "afd_step_hook", None) is None:
        model.afd_step_hook = model.register_forward_pre_hook(forward_pre_hook,
                                                              with_kwargs=True)  # fmt: skip


def forward_pre_hook(module, args: tuple, kwargs: dict) -> None:
    """On the model: its forward opens the step (AttentionClient.begin_forward). A
    forward of a later pipeline stage (intermediate tensors) opens it at its first
    remote layer as before."""
    given = {**dict(zip(_FORWARD_ARGS, args)), **kwargs}
    if given.get("intermediate_tensors") is not None:
        return
    tokens = given.get("inputs_embeds")
    if tokens is None:
        tokens = given.get("input_ids")
    if isinstance(tokens, torch.Tensor):
        CLIENT.begin_forward(tokens.shape[0])


def guard_forward(forward, ubatched: bool = False):
    """The model runner's forward callable as this process runs it (the in-tree
    hook of the model runners calls this): vllm.afd.rejoin.guard with this
    process's connector; ``forward`` itself unless that is cuda_ipc with ipc_rejoin."""
    return rejoin.guard(CLIENT.connector, forward, ubatched)


def _afd_remote_ffn(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return CLIENT.exchange(hidden_states, layer_idx)


def _afd_remote_ffn_fake(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)


def _afd_remote_ffn_gated(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, layer_idx: int
) -> torch.Tensor:
    return CLIENT.exchange(hidden_states, layer_idx, router_logits)


def _afd_remote_ffn_gated_fake(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, layer_idx: int
) -> torch.Tensor:
    return torch.empty_like(hidden_states)


_registered = False


def _register_op() -> None:
    global _registered
    if _registered:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(
        op_name="afd_remote_ffn",
        op_func=_afd_remote_ffn,
        mutates_args=[],
        fake_impl=_afd_remote_ffn_fake,
    )
    direct_register_custom_op(
        op_name="afd_remote_ffn_gated",
        op_func=_afd_remote_ffn_gated,
        mutates_args=[],
        fake_impl=_afd_remote_ffn_gated_fake,
    )
    _registered = True
