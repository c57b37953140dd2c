# SPDX-License-Identifier: Apache-2.0
"""The one home of the upstream micro-batching (DBO) names the AFD overlay uses, on
every vLLM line it is built for (the overlay is shared by all targets).

Upstream changes this module absorbs:

* vLLM 0.32.0 gave model runner V2 a micro-batch runner, ``UBatchRunner``
  (``vllm/v1/worker/gpu/ubatch_utils.py``), where AFD hooks in through
  :mod:`vllm.afd.dbo_v2` (patch 0018 of targets 0.32.0 and 0.33.0, 0016 of 0.34.0);
  :data:`HAS_V2_UBATCH_RUNNER`.
* vLLM 0.34.0 deleted model runner V1 (``gpu_model_runner.py``,
  ``cpu_model_runner.py``, ``gpu_ubatch_wrapper.py``), so runner V2's
  ``UBatchRunner`` is the only one left. On the lines that still have V1 (0.26.0 to
  0.33.0) its CUDA ``UBatchWrapper`` micro-batches (patch 0012), and the CPU
  micro-batch wrapper of :mod:`vllm.afd.dbo` runs with the V1 CPU model runner;
  :data:`HAS_V1_RUNNER`.

Both are decided once, at import.
* ``vllm.v1.worker.ubatching`` keeps the micro-batch contexts in module state
  with private names only (``_NUM_UBATCHES``, ``_CURRENT_CONTEXTS``,
  ``_THREAD_ID_TO_CONTEXT``); its public ``make_ubatch_contexts`` builds contexts
  with CUDA events, which the CPU wrapper cannot use. The CPU wrapper registers its
  own contexts through :func:`register_contexts` and :func:`enter_context`, the only
  places that touch those names (the same on 0.26.0 to 0.34.0).

Everything else (which micro-batch a thread runs, the hand-over) goes through
ubatching's public functions, unchanged from 0.26.0 to 0.34.0.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

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
