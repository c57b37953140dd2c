# SPDX-License-Identifier: Apache-2.0
"""The FFN role in EngineCore and in the frontend.

An FFN engine builds the executor only (the worker's FFN model runner starts
serving once its weights are loaded): no KV cache, no scheduler, no
structured-output manager. Its busy loop still answers utility calls (health,
shutdown); generation requests are refused by the frontend with a clear
error; a failure of the serve loop ends the engine with that error.
"""

from __future__ import annotations

import queue

from vllm.afd import compat, failure
from vllm.afd.attention import CLIENT
from vllm.afd.roles import is_ffn
from vllm.logger import init_logger

logger = init_logger(__name__)

FFN_REFUSAL = (
    "this vLLM server is an AFD FFN rank: it serves FFN layers to its attention "
    "servers and does not take generation requests. Send requests to the "
    "attention server."
)


class _NoStructuredOutput:
    def clear_backend(self) -> None:
        pass


class FFNRoleScheduler:
    """Stands in for the scheduler of an FFN engine: it never has work."""

    connector = None
    kv_cache_config = None

    def has_requests(self) -> bool:
        return False

    def has_unfinished_requests(self) -> bool:
        return False

    def get_num_unfinished_requests(self) -> int:
        return 0

    def finish_requests(self, request_ids, finished_status):
        return []

    def add_request(self, request) -> None:
        raise ValueError(FFN_REFUSAL)

    def get_kv_connector(self):
        return None

    def get_kv_event_publisher_config(self):  # vLLM >= 0.32 ready response
        return None

    def get_ec_connector(self):
        return None

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def setup_ffn_engine_core(engine) -> None:
    """Finish ``EngineCore.__init__`` for the FFN role (executor already built)."""
    engine.structured_output_manager = _NoStructuredOutput()
    engine.scheduler = FFNRoleScheduler()
    engine.use_spec_decode = False
    engine.check_for_draft_tokens = False
    engine.batch_queue_size = 1
    engine.batch_queue = None
    engine.is_ec_consumer = True
    engine.is_pooling_model = False
    engine.request_block_hasher = None
    engine.mm_receiver_cache = None
    engine.step_fn = lambda: ({}, False)
    engine.async_scheduling = False
    engine.aborts_queue = queue.Queue()
    engine._idle_state_callbacks = []

    def on_fatal(message: str) -> None:
        logger.error("AFD FFN rank failed: %s", message)
        engine.afd_ffn_error = message
        input_queue = getattr(engine, "input_queue", None)
        if input_queue is not None:
            from vllm.v1.engine import EngineCoreRequestType

            input_queue.put_nowait((EngineCoreRequestType.EXECUTOR_FAILED, b""))

    engine.afd_ffn_error = None
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    if isinstance(engine.model_executor, UniProcExecutor):
        # Worker in this process: its serve loop reports straight to us.
        engine.model_executor.collective_rpc(_register_fatal_callback, args=(on_fatal,))
    else:
        # Worker processes: a failed serve loop ends its worker, and the
        # executor's worker monitor then fails this engine.
        engine.model_executor.collective_rpc(_exit_worker_on_fatal)
    logger.info("AFD FFN role: engine core ready (no KV cache, no scheduler)")


def _register_fatal_callback(worker, callback) -> None:
    runner = worker.model_runner
    runner.on_fatal.append(callback)
    if runner.error is not None:
        callback(runner.error)


def _exit_worker_on_fatal(worker) -> None:
    _register_fatal_callback(worker, _exit_worker)


def _exit_worker(message: str) -> None:
    import sys

    print(f"AFD FFN rank failed: {message}; ending this worker", file=sys.stderr, flush=True)
    failure.exit_now(message)


def worker_profile_hook(worker, is_start: bool) -> bool:
    """Hook at the top of ``Worker.profile``. The attention role also starts/
    stops the FFN rank's profiler; the FFN role profiles its serve thread
    instead of the (idle) worker. True when the worker must do nothing more."""
    cfg = getattr(worker.vllm_config, "afd_config", None)
    if cfg is None:
        return False
    if cfg.role == "ffn":
        worker.model_runner.request_profile(is_start)
        return True
    if is_start:
        _profile_all_threads(worker)
    CLIENT.profile(is_start)
    return False


def _profile_all_threads(worker) -> None:
    """With --enable-dbo the micro-batch threads run the forward passes (their AFD
    exchanges included), but vLLM's torch profiler records only the thread that
    starts it. Where the worker's profiler exists and has not started yet (the CPU
    worker builds it up front), ask it to record every thread."""
    if not getattr(worker.vllm_config.parallel_config, "enable_dbo", False):
        return
    prof = getattr(getattr(worker, "profiler", None), "profiler", None)
    if prof is None:
        return
    why = compat.profile_all_threads(prof)
    if why is not None:  # an older torch: traces lack the threads
        logger.warning("AFD: cannot record the DBO micro-batch threads in traces: %s", why)


_ENGINE_DIED = False


def note_engine_death() -> None:
    """Hook where the API server shuts down because its engine died."""
    global _ENGINE_DIED
    _ENGINE_DIED = True


def exit_if_engine_died() -> None:
    """Hook after ``vllm serve``'s server loop: a server that stopped because its
    engine died (e.g. an AFD peer was lost) exits with status 1, not 0, so that a
    supervisor (systemd ``Restart=on-failure``, Kubernetes) restarts it."""
    if _ENGINE_DIED:
        import sys

        logger.error("vLLM API server stopped because its engine died; exiting with status 1")
        sys.exit(1)


def reject_generation(vllm_config) -> None:
    """Frontend hook: refuse generation on an FFN server with a clear error."""
    if is_ffn(vllm_config):
        # A client error for every vLLM: 0.26.0 maps ValueError to HTTP 400, while
        # 0.32.0 maps only VLLMClientError (its VLLMValidationError) to a 4xx.
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(FFN_REFUSAL)
