# SPDX-License-Identifier: Apache-2.0
"""The one home of what differs between the vLLM (and torch) lines the overlay is built
for, and of the upstream private names it must use (the overlay is shared by all
targets). Which model families each line supports is data, in
:mod:`vllm.afd.architectures` (``Family.lines``, ``running_line``).

Micro-batching (DBO), upstream changes this module absorbs:

* vLLM 0.32.0 gave model runner V2 a micro-batch runner, ``UBatchRunner``
  (``vllm/v1/worker/gpu/ubatch_utils.py``), where AFD hooks in through
  :mod:`vllm.afd.dbo_v2` (patch ``dbo-runner-v2``);
  :data:`HAS_V2_UBATCH_RUNNER`.
* vLLM 0.34.0 deleted model runner V1 (``gpu_model_runner.py``,
  ``cpu_model_runner.py``, ``gpu_ubatch_wrapper.py``), so runner V2's
  ``UBatchRunner`` is the only one left. On the lines that still have V1 (0.26.0 to
  0.33.0) its CUDA ``UBatchWrapper`` micro-batches (patch ``dbo-runner-v1``), and the CPU
  micro-batch wrapper of :mod:`vllm.afd.dbo` runs with the V1 CPU model runner;
  :data:`HAS_V1_RUNNER`.

Both are decided once, at import.
* ``vllm.v1.worker.ubatching`` keeps the micro-batch contexts in module state
  with private names only (``_NUM_UBATCHES``, ``_CURRENT_CONTEXTS``,
  ``_THREAD_ID_TO_CONTEXT``); its public ``make_ubatch_contexts`` builds contexts
  with CUDA events, which the CPU wrapper cannot use. The CPU wrapper registers its
  own contexts through :func:`register_contexts` and :func:`enter_context`, the only
  places that touch those names (the same on 0.26.0 to 0.34.0).
* The CPU wrapper's context (:func:`cpu_context_class`) subclasses ``UBatchContext``
  and overrides its private hand-over steps (``_signal_comm_done``, ``_cpu_yield``, ...)
  and reads ``forward_context._forward_context``: unchanged from 0.26.0 to 0.34.0.

Everything else (which micro-batch a thread runs, the hand-over) goes through
ubatching's public functions, unchanged from 0.26.0 to 0.34.0.

The MoE runner's gate (:func:`swap_router`): from vLLM 0.32.0 on, ``FusedMoE`` may hold
the router itself (``experts.gate``, the block passing the hidden states as
"router_logits") and fuse it with a shared-expert gate (the private
``experts._fse_fuse_gate``); 0.26.0 has neither.

torch's profiler (:func:`profile_all_threads`): the field that makes it record every
thread (``experimental_config`` with ``_ExperimentalConfig(profile_all_threads=True)``,
a private torch name) is missing from older torch builds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

import torch

# Model runner V1 and its CUDA UBatchWrapper exist (vLLM <= 0.33.0).
HAS_V1_RUNNER = importlib.util.find_spec("vllm.v1.worker.gpu_ubatch_wrapper") is not None
# Model runner V2 micro-batches with its UBatchRunner (vLLM >= 0.32.0).
HAS_V2_UBATCH_RUNNER = importlib.util.find_spec("vllm.v1.worker.gpu.ubatch_utils") is not None


def ubatch_id() -> int | None:
    """Index of the micro-batch the calling thread runs; None outside DBO."""
    from vllm.v1.worker import ubatching

    return ubatching.dbo_current_ubatch_id() if ubatching.dbo_enabled() else None


def yield_turn() -> None:
    """Hand the turn to the next micro-batch (no-op outside DBO)."""
    from vllm.v1.worker.ubatching import dbo_yield

    dbo_yield()


def register_contexts(num_ubatches: int) -> None:
    """What upstream's ``make_ubatch_contexts`` sets up for ``num_ubatches``
    contexts (private module state; see the module docstring)."""
    from vllm.v1.worker import ubatching

    ubatching._NUM_UBATCHES = num_ubatches
    current = ubatching._CURRENT_CONTEXTS
    if len(current) < num_ubatches:
        current.extend([None] * (num_ubatches - len(current)))


def enter_context(ctx: Any) -> None:
    """What upstream's ``UBatchContext.__enter__`` records for the calling thread
    (private module state; ``__exit__``, which the CPU context keeps, undoes it)."""
    from vllm.v1.worker import ubatching

    ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = ctx.id
    ubatching._CURRENT_CONTEXTS[ctx.id] = ctx


def merge_v1_outputs(outputs: list) -> Any:
    """The full-batch output from the micro-batches' outputs, as model runner V1's
    UBatchWrapper builds it (only a private helper there; the CPU wrapper runs only
    where V1 exists, :data:`HAS_V1_RUNNER`)."""
    if not HAS_V1_RUNNER:
        raise RuntimeError(
            "AFD DBO: the CPU micro-batch wrapper needs vLLM's model runner V1, which "
            "this vLLM does not have; drop --enable-dbo on the CPU"
        )
    from vllm.v1.worker.gpu_ubatch_wrapper import _cat_ubatch_outputs

    return _cat_ubatch_outputs(outputs)


def cpu_context_class() -> type:
    """vLLM's ``UBatchContext`` for the CPU micro-batch wrapper of :mod:`vllm.afd.dbo`: it
    overrides the context's private hand-over steps (the CUDA stream and event ones become
    no-ops, the CPU yield can be aborted) and reads the forward context's private current
    value, so it lives here (see the module docstring)."""
    from vllm import forward_context
    from vllm.v1.worker.ubatching import UBatchContext

    class CPUUBatchContext(UBatchContext):
        """vLLM's micro-batch hand-over (threading events, one thread runs at a
        time) without CUDA streams or events."""

        def update_stream(self, stream) -> None:
            self.current_stream = stream

        def _signal_comm_done(self) -> None:
            pass

        def _signal_compute_done(self) -> None:
            pass

        def _wait_compute_done(self) -> None:
            pass

        def _wait_comm_done(self) -> None:
            pass

        abort: threading.Event | None = None

        def _cpu_yield(self) -> None:
            assert forward_context._forward_context == self.forward_context
            assert not self.cpu_wait_event.is_set()
            self.cpu_signal_event.set()
            self._wait_turn()
            self._restore_context()

        def _wait_turn(self) -> None:
            while not self.cpu_wait_event.wait(0.05):
                if self.abort is not None and self.abort.is_set():
                    raise RuntimeError("AFD DBO: the other micro-batch of this step failed")
            self.cpu_wait_event.clear()

        def __enter__(self):
            enter_context(self)
            self.ready_barrier.wait()
            self._wait_turn()
            self._restore_context()
            return self

    return CPUUBatchContext


# ------------------------------------------------------------------ MoE runner gate
@contextlib.contextmanager
def swap_router(block: torch.nn.Module, name: str, stub: torch.nn.Module) -> Iterator[None]:
    """While the context runs, the MoE block ``block`` routes with ``stub`` in place of
    its router ``name``: the block's own module, and the MoE runner's copy of the gate
    where the line has one (vLLM >= 0.32.0), its fusion with a shared-expert gate off."""
    experts = block.experts
    gate, runner_gate = getattr(block, name), getattr(experts, "gate", None)
    fused = getattr(experts, "_fse_fuse_gate", None)
    block._modules[name] = stub
    if runner_gate is not None:
        experts.gate = stub
        if fused:
            experts._fse_fuse_gate = False
    try:
        yield
    finally:
        block._modules[name] = gate
        if runner_gate is not None:
            experts.gate = runner_gate
            if fused:
                experts._fse_fuse_gate = fused


# ------------------------------------------------------------------ torch profiler
def profile_all_threads(prof: Any) -> str | None:
    """Ask the torch profiler ``prof`` (not started yet, no config of its own) to record
    every thread. Returns why it cannot (an older torch), None when done or when ``prof``
    sets its own config."""
    if getattr(prof, "experimental_config", "absent") is not None:
        return None  # one that sets its own config, or a torch without the field
    try:
        from torch._C._profiler import _ExperimentalConfig

        prof.experimental_config = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError) as e:
        return str(e)
    return None
