# SPDX-License-Identifier: Apache-2.0
"""DBO for the AFD attention role on vLLM's model runner V2 (the only runner from
vLLM 0.34.0 on; ``vllm/v1/worker/gpu/``), on CUDA.

Runner V2 micro-batches a step with its ``UBatchRunner`` (one thread per
micro-batch, CUDA streams, FULL graphs of micro-batched decode steps), but builds
it and decides the split only when data parallelism coordinates them: at
data-parallel size 1 ``maybe_build_ubatch_runner`` gives none and
``dispatch_cg_and_sync_dp`` never splits. The AFD hook patch of the target
(``worker: DBO on model runner V2 ...``) calls in here instead, for the AFD
attention role:

* :func:`build_runner` - the runner, with the AFD additions of :func:`runner_class`
  (the step's micro-batch token counts for the connector, :func:`vllm.afd.dbo.note_ubatch_tokens`;
  a failed micro-batch ends the engine, :func:`vllm.afd.dbo.ubatch_failed`, since the
  other one would wait for its hand-over forever);
* :func:`dispatch` - the split decision of one step, the local counterpart of the
  data-parallel agreement: :func:`vllm.afd.dbo.should_ubatch` (vLLM's DBO
  thresholds and AFD's floor), then the step's descriptor: the captured FULL graph
  of the micro-batched step where one exists and its last micro-batch holds real
  tokens, the whole step's own graph where the micro-batched one would not, or an
  eager micro-batched step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.afd import dbo
from vllm.logger import init_logger

logger = init_logger(__name__)


def dispatch(
    batch_desc: Any,
    cudagraph_manager: Any,
    parallel_config: Any,
    *,
    num_reqs: int,
    num_tokens: int,
    uniform_token_count: int | None,
    uniform_decode: bool,
    num_active_loras: int = 0,
) -> Any:
    """The descriptor the runner executes this step with: ``batch_desc`` (the whole
    step, as dispatched without micro-batches) or a micro-batched one
    (``num_ubatches > 1``)."""
    from vllm.config import CUDAGraphMode

    if not dbo.should_ubatch(parallel_config, num_tokens, uniform_decode, allow=True):
        return batch_desc
    n = parallel_config.num_ubatches
    if batch_desc.cg_mode == CUDAGraphMode.FULL and cudagraph_manager is not None:
        graph = cudagraph_manager.dispatch(
            num_reqs, num_tokens, uniform_token_count,
            num_active_loras=num_active_loras, num_ubatches=n,
        )  # fmt: skip
        if graph.cg_mode == CUDAGraphMode.FULL and dbo.should_ubatch(
            parallel_config, num_tokens, uniform_decode, True, num_tokens_padded=graph.num_tokens
        ):
            return graph
        # No micro-batched graph of this size, or its padding would leave the last
        # micro-batch without a real token: the whole step replays its own graph.
        return batch_desc
    return dataclasses.replace(
        batch_desc,
        cg_mode=CUDAGraphMode.NONE,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        uniform_token_count=uniform_token_count,
        max_query_len=None,
        num_ubatches=n,
    )


_runner_classes: dict[type, type] = {}


def runner_class(base: type) -> type:
    """``base`` (runner V2's ``UBatchRunner``) with the AFD additions."""
    if base not in _runner_classes:

        class AFDUBatchRunner(base):
            """Runner V2's micro-batch runner for the AFD attention role."""

            def begin_capturable_run(self, model, model_inputs, ubatch_state, *args, **kw):
                dbo.note_ubatch_tokens(ubatch_state.slices)
                return super().begin_capturable_run(
                    guarded(model), model_inputs, ubatch_state, *args, **kw
                )

        _runner_classes[base] = AFDUBatchRunner
    return _runner_classes[base]


def guarded(model: Any):
    """``model`` for a micro-batch thread: an error ends the engine
    (:func:`vllm.afd.dbo.ubatch_failed`) before it is re-raised to the runner."""

    def run(**inputs):
        try:
            return model(**inputs)
        except BaseException as e:  # noqa: BLE001 - re-raised
            dbo.ubatch_failed(f"DBO micro-batch failed: {type(e).__name__}: {e}")
            raise

    return run


def build_runner(base: type, vllm_config: Any, device: Any, *args: Any) -> Any:
    """The AFD attention role's micro-batch runner at data-parallel size 1
    (``args``: the rest of ``base``'s constructor arguments)."""
    if getattr(device, "type", None) != "cuda":
        raise ValueError(
            f"AFD: --enable-dbo on model runner V2 runs on CUDA only (this worker runs on "
            f"{device}); drop --enable-dbo"
        )
    parallel = vllm_config.parallel_config
    logger.info(
        "AFD attention role: DBO on model runner V2, %d micro-batches per step from %d "
        "decode / %d prefill tokens on",
        parallel.num_ubatches,
        parallel.dbo_decode_token_threshold,
        parallel.dbo_prefill_token_threshold,
    )
    return runner_class(base)(vllm_config, device, *args)
