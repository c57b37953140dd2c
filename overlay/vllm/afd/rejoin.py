# SPDX-License-Identifier: Apache-2.0
"""Rejoin a lost FFN rank and re-run the interrupted step (attention role).

The attention role owns the scheduler, the KV cache and sampling; an FFN rank
keeps nothing from one step to the next. When the FFN rank is lost during a
step (EOF, reset, no answer within ``timeout_s``), the layer exchange that
failed holds the step: the connector reconnects to the FFN rank's address with
backoff and re-handshakes (the same fingerprint, revision and topology, else
the engine fails at once), then the step's FFN exchanges are re-run from its
first layer under a new step id. The layers before the interrupted one were
computed already (their outputs are in the residual stream, their KV written):
they are re-sent as zero rows of the same shape, whose outputs are dropped, so
the FFN rank walks the step's layers in order as it always does; the
interrupted layer is sent its real input and the step goes on. Sampling happens
after the last layer, so the step's output is the one an uninterrupted step
gives. Requests in flight continue; new ones queue in the engine meanwhile.

Bounded: the FFN rank has ``rejoin_timeout_s`` (default ``timeout_s``) from the
loss to come back; after that the step fails with the loss's error, as without
rejoin. A micro-batched (DBO) step, a connector without ``can_rejoin``
(``cuda_ipc`` by default; ``nccl`` once a CUDA graph captured its communicator) and
``rejoin_timeout_s`` 0 keep the fail-fast path. On ``cuda_ipc`` with
``connector_extra_config.ipc_rejoin`` (opt-in; docs/connectors.md says what the H200
proved), on ``nccl`` and on ``nixl``'s device path the whole forward re-runs
(``reruns_forward``): ``run_forward``, which the model runners' forward calls reach
through ``guard`` (the in-tree hook calls ``vllm.afd.attention.guard_forward``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from vllm.afd import failure
from vllm.afd.protocol import AFDHandshakeError, AFDPeerError
from vllm.logger import init_logger

logger = init_logger(__name__)
T = TypeVar("T")


def possible(conn, ubatched: bool) -> bool:
    """A lost FFN rank may be rejoined in this step: the connector can, the
    window is not 0 and the step is not micro-batched."""
    if conn is None or not conn.can_rejoin or ubatched:
        return False
    return conn.ctx.config.rejoin_window_s > 0


def resume(conn, rerun: Callable[[object], torch.Tensor], error: Exception) -> torch.Tensor:
    """Reconnect ``conn`` and ``rerun(conn)`` the step, again after every loss,
    until ``rejoin_timeout_s`` after the first one. Raises AFDPeerError (with
    ``error``'s text first) when the FFN rank does not come back in time, and
    AFDHandshakeError at once for a peer of another deployment."""
    window = conn.ctx.config.rejoin_window_s
    lost = conn.lost_at() or time.monotonic()
    deadline = lost + window
    logger.warning("AFD: %s; holding the step and rejoining (rejoin_timeout_s=%g)", error, window)
    last: Exception = error
    while True:
        try:
            conn.reconnect(deadline)
        except AFDHandshakeError:
            raise
        except AFDPeerError as e:
            raise AFDPeerError(
                f"{error}; it did not come back within rejoin_timeout_s={window:g} ({e})"
            ) from e
        try:
            out = rerun(conn)
        except AFDPeerError as e:  # lost again during the re-run
            last = e
            if time.monotonic() >= deadline:
                raise AFDPeerError(
                    f"{error}; lost again while re-running the step, and "
                    f"rejoin_timeout_s={window:g} has passed ({last})"
                ) from e
            continue
        logger.info("AFD: the interrupted step re-ran %.2f s after the loss",
                    time.monotonic() - lost)  # fmt: skip
        return out


def rerun_step(
    conn,
    step_id: int,
    before: list[bool],
    x: torch.Tensor,
    router_logits: torch.Tensor | None,
) -> torch.Tensor:
    """Open step ``step_id`` of ``x``'s token count, exchange zero rows for the
    layers ``before`` the interrupted one (True: that layer also sends router
    logits, ``conn.ctx.num_router_logits`` wide) and ``x`` for it; its FFN output."""
    n = x.shape[0]
    conn.begin_step(step_id, n)
    zeros = torch.zeros_like(x)
    scratch = torch.empty_like(x)
    width = conn.ctx.num_router_logits or 0
    zero_logits = torch.zeros((n, width), dtype=torch.float32, device=x.device)
    for gated in before:
        conn.send(zeros)
        if gated:
            conn.send(zero_logits)
        conn.recv(scratch)
    conn.send(x)
    if router_logits is not None:
        conn.send(router_logits.to(torch.float32).contiguous())
    return conn.recv(torch.empty_like(x))


# ------------------------------------------------- cuda_ipc: re-run the forward
def guard(conn, forward: Callable[..., T], ubatched: bool = False) -> Callable[..., T]:
    """The model runner's forward callable ``forward`` (the model, a CUDA-graph
    replay, a micro-batched run) as this attention rank must call it, given its
    connector ``conn``: ``forward`` itself (nothing added) unless ``conn`` is a
    cuda_ipc connector with ``ipc_rejoin``; then each call runs under
    ``run_forward``, or, for a micro-batched (DBO) step (``ubatched``), under
    ``run_fail_fast``."""
    if conn is None or not conn.reruns_forward:
        return forward
    if ubatched:
        return lambda *args, **kwargs: run_fail_fast(conn, lambda: forward(*args, **kwargs))
    return lambda *args, **kwargs: run_forward(conn, lambda: forward(*args, **kwargs))


def run_fail_fast(conn, forward: Callable[[], T]) -> T:
    """A micro-batched (DBO) forward on cuda_ipc with ``ipc_rejoin``: not re-run
    (two threads share its exchanges), so it keeps the fail-fast path. A loss
    held since the last forward is rejoined first (``run_forward`` of nothing);
    during the forward a loss is not held (the watchdog ends the rank, as without
    rejoin); a loss found after it (held just before) fails the step with
    AFDPeerError: its output never reaches sampling."""
    if _capturing():
        return forward()
    run_forward(conn, _nothing)
    conn.forwards_guarded = False
    try:
        out = forward()
        lost = conn.step_lost()
    finally:
        conn.forwards_guarded = True
    if lost is not None:
        _give_up(conn, f"{lost}; a micro-batched (DBO) step is not re-run")
    return out


def _nothing() -> None:
    return None


def run_forward(conn, forward: Callable[[], T]) -> T:
    """The model forward ``forward()`` (an eager pass or a CUDA-graph replay) of
    an attention rank on cuda_ipc with ``connector_extra_config.ipc_rejoin``: a
    graph cannot re-run half a step, so a step during which the FFN rank was lost
    runs again whole once the rank is back (its KV writes are the same again).
    After each pass the device work is waited for and the connector says whether
    the FFN rank was lost during it (``step_lost``: the watchdog's EOF, a wait's
    error word); the output of such a pass is dropped, so sampling only ever sees
    a clean pass. Bounded by ``rejoin_timeout_s`` from the first loss; then
    AFDPeerError as without rejoin. Any other connector: ``forward()``."""
    if conn is None or not conn.reruns_forward:
        return forward()
    if _capturing():  # a capture runs nothing; a synchronisation would break it
        return forward()
    conn.forwards_guarded = True
    if not conn.holds_losses():
        if not conn.checks_every_forward:
            return forward()
        # The pass's device work is waited for here (the GIL released) and checked:
        # a pass that lost its FFN rank never reaches sampling; without a held re-run
        # it ends the rank by name.
        out = forward()
        lost = conn.step_lost()
        if lost is not None:
            _give_up(conn, lost)
        return out
    window = conn.ctx.config.rejoin_window_s
    first: str | None = None
    deadline = 0.0
    while True:
        try:
            out = forward()
            lost = conn.step_lost()
        except AFDPeerError as e:  # eager: begin_step of a lost connection
            lost = str(e)
        if lost is None:
            if first is not None:
                logger.info("AFD: the interrupted forward re-ran clean %.2f s after the "
                            "loss", time.monotonic() - (deadline - window))  # fmt: skip
            return out
        if first is None:
            first = lost
            deadline = (conn.lost_at() or time.monotonic()) + window
            logger.warning("AFD: %s; holding the step and rejoining (rejoin_timeout_s=%g)",
                           lost, window)  # fmt: skip
        elif time.monotonic() >= deadline:
            _give_up(conn, f"{first}; lost again while re-running the step, and "
                     f"rejoin_timeout_s={window:g} has passed ({lost})")  # fmt: skip
        try:
            conn.reconnect(deadline)
        except AFDPeerError as e:
            _give_up(conn, f"{first}; it did not come back within rejoin_timeout_s="
                     f"{window:g} ({e})", e)  # fmt: skip


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _give_up(conn, msg: str, cause: Exception | None = None) -> None:
    failure.record("attention", conn.ctx.rank, msg)
    raise AFDPeerError(msg) from cause
