# SPDX-License-Identifier: Apache-2.0
"""DBO (``--enable-dbo``, two micro-batches) for the AFD attention role at
data-parallel size 1.

vLLM splits a step into micro-batches only when data parallelism coordinates
it (and only with a DeepEP / NIXL all-to-all); the attention role of AFD has
no MoE layer of its own - the remote-FFN op replaces the all-to-all - so here
the split is decided locally (:func:`should_ubatch`) and the micro-batches run
in two threads that hand over at the remote-FFN op: micro-batch 0 sends a
layer's FFN input and yields, micro-batch 1 computes its attention for that
layer meanwhile, sends and yields back, and so on. The FFN rank therefore
serves the two micro-batches alternately, layer by layer (see
``vllm.afd.ffn_runner``), while the attention computes the other one.

On CUDA vLLM's own micro-batch runner runs the threads (streams, graphs; it
is told the token counts of the step's micro-batches, :func:`note_ubatch_tokens`,
which the cuda_ipc connector announces in micro-batch 0's control message):
model runner V1's ``UBatchWrapper`` (patch ``dbo-runner-v1``, vLLM <= 0.33.0) or model runner
V2's ``UBatchRunner`` (:mod:`vllm.afd.dbo_v2`, the only runner from vLLM 0.34.0
on). The CPU has no streams, so :class:`CPUUBatchWrapper` runs them with the same
hand-over (vLLM's ``UBatchContext`` with the stream work left out; model runner
V1 only). Where upstream's names differ between lines: :mod:`vllm.afd.compat`.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from vllm.afd import compat, failure
from vllm.afd.architectures import routed_experts
from vllm.logger import init_logger

logger = init_logger(__name__)

# Token counts of the micro-batches of the step being run (set by the wrapper
# in the runner's thread before the micro-batch threads start).
_step_tokens: list[int] | None = None


def note_ubatch_tokens(ubatch_slices: Any) -> None:
    """Called by the micro-batch wrappers with the step's ``ubatch_slices``."""
    global _step_tokens
    _step_tokens = [int(s.num_tokens) for s in ubatch_slices]


def step_ubatch_tokens() -> list[int] | None:
    return None if _step_tokens is None else list(_step_tokens)


def current_ubatch() -> tuple[int, int]:
    """(index, count) of the micro-batch the calling thread runs; (0, 0) outside DBO."""
    index = compat.ubatch_id()
    if index is None:
        return 0, 0
    if _step_tokens is None:
        raise RuntimeError(
            "AFD DBO: a micro-batch thread runs but its runner did not call "
            "vllm.afd.dbo.note_ubatch_tokens (an AFD hook patch is missing)"
        )
    return index, len(_step_tokens)


# Called with the failure message when a micro-batch of vLLM's CUDA micro-batch
# runner raised; the default ends the process. Tests replace it.
on_ubatch_failure = None
_hook_installed = False
_rank = 0


def ubatch_failed(msg: str) -> None:
    """A micro-batch of a CUDA DBO step failed: the other one waits for a hand-over
    that never comes (vLLM's micro-batch threads have no error path), and the step
    would end only at the connector's timeout, reported as a silent FFN peer. Record
    the real error for the engine-death message and end the process at once."""
    logger.error("AFD: %s; ending the engine (the other micro-batch cannot go on)", msg)
    failure.record("attention", _rank, msg)
    (on_ubatch_failure or failure.exit_now)(msg)


def watch_ubatch_threads(vllm_config: Any, rank: int) -> bool:
    """CUDA DBO: a failed micro-batch ends the engine (:func:`ubatch_failed`, which
    reports as ``rank``). Model runner V2's micro-batch threads catch their errors
    and :mod:`vllm.afd.dbo_v2` reports them; model runner V1's let them escape, to
    a thread exception hook installed here. True when the hook is installed."""
    global _hook_installed, _rank
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    if not enabled(vllm_config) or getattr(device, "type", None) != "cuda":
        return False
    _rank = rank
    if _hook_installed:
        return True
    previous = threading.excepthook

    def hook(args) -> None:
        previous(args)  # the traceback, as usual
        name = getattr(args.thread, "name", "") or ""
        if "_ubatch_thread" not in name:  # V1's (_capture)_ubatch_thread targets
            return
        ubatch_failed(f"DBO micro-batch thread failed: {args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    _hook_installed = True
    return True


def enabled(vllm_config: Any) -> bool:
    """DBO requested on an AFD attention role (any device)."""
    cfg = getattr(vllm_config, "afd_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    return (
        cfg is not None
        and cfg.is_attention
        and parallel is not None
        and bool(getattr(parallel, "enable_dbo", False))
    )


def replaces_all2all(vllm_config: Any) -> bool:
    """True when micro-batching needs no all-to-all backend: the AFD attention
    role has no MoE layer (the FFN rank runs them)."""
    return enabled(vllm_config)


# ----------------------------------------------------- when splitting pays
# FLOP per byte of weights read at which the FFN rank's expert (or MLP) kernels stop
# being bound by reading the weights, on CUDA. Measured on one H200 for the
# DeepSeek-V2-Lite MoE layer (benchmarks/moe_crossover.py, docs/benchmarks.md): the
# layer's time stays flat up to about 1,024 tokens (64 experts, top-6), i.e. about
# 96 tokens per expert with bf16 weights (2 FLOP per weight and token, 2 bytes).
CUDA_FLOPS_PER_BYTE = 100.0

# Steps of fewer tokens run whole (set by configure() when the attention role starts).
_min_tokens = 0


def moe_shape(hf_config: Any) -> tuple[int, int]:
    """(routed experts, experts per token) of a model config; (1, 1) for a dense MLP."""
    text = getattr(hf_config, "text_config", None) or hf_config
    experts = routed_experts(text)
    top_k = next(
        (
            getattr(text, k)
            for k in ("num_experts_per_tok", "moe_topk", "top_k")
            if getattr(text, k, None)
        ),
        0,
    )
    if not experts or not top_k:
        return 1, 1
    return int(experts), int(top_k)


def break_even_tokens(
    num_experts: int, top_k: int, weight_bytes: int, flops_per_byte: float
) -> int:
    """Smallest step worth splitting into two micro-batches, from the bytes the FFN
    rank reads. While a layer's expert kernels are bound by reading the weights,
    their time does not depend on the token count, and each micro-batch reads
    every active expert again: two micro-batches cost twice the weight reads of
    the whole step, more than overlapping attention with the FFN can win back.
    Splitting pays only once half the step makes the experts compute-bound: each
    expert then gets ``T/2 * top_k / num_experts`` tokens, doing 2 FLOP per weight
    and token over ``weight_bytes`` per weight, at least ``flops_per_byte``."""
    per_expert = flops_per_byte * weight_bytes / 2.0  # tokens per expert at the knee
    knee = math.ceil(per_expert * num_experts / top_k)
    return 2 * knee


# The floor when both roles compute on one GPU: no step is split.
NEVER = 1 << 62


def runner_moved_by_dbo(vllm_config: Any) -> bool:
    """True when ``--enable-dbo`` made vLLM run this model on its model runner V1 where,
    without the flag, it runs it on model runner V2. vLLM picks V2 by default for some
    MoE architectures (DeepseekV2ForCausalLM among them on 0.26.0) unless the configuration
    asks for something V2 lacks, and 0.26.0's V2 lacks DBO. The two runners build a step
    differently (metadata, padding, sampler), so a server with ``--enable-dbo`` rounds
    differently in bf16 from one without it even in the steps it does not split: a greedy
    token may differ where plain vLLM's top two are within that rounding. Decided by
    vLLM's own runner choice (``VllmConfig.use_v2_model_runner``) with and without DBO."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if not getattr(parallel, "enable_dbo", False) or vllm_config.use_v2_model_runner:
        return False
    parallel.enable_dbo = False
    try:
        return bool(vllm_config.use_v2_model_runner)
    finally:
        parallel.enable_dbo = True


# What the attention role logs when runner_moved_by_dbo (a GPU oracle case looks for it).
RUNNER_MOVED = (
    "--enable-dbo runs this model on vLLM's model runner V1 (without it vLLM runs it on "
    "model runner V2, which has no DBO in this vLLM)"
)


def runner_note(vllm_config: Any) -> str | None:
    """The warning of an attention role whose model runner ``--enable-dbo`` changed
    (:func:`runner_moved_by_dbo`), or None."""
    if not runner_moved_by_dbo(vllm_config):
        return None
    return (
        f"AFD attention role: {RUNNER_MOVED}: its bf16 results differ from a server's "
        "without --enable-dbo also in steps it does not split, so a greedy token may differ "
        "where two candidates are near-tied; compare it with a server run with "
        "VLLM_USE_V2_MODEL_RUNNER=0, or drop --enable-dbo to compute as that server does"
    )


def configure(vllm_config: Any, shares_device: bool | None = None) -> int:
    """Set (and log) the smallest step split into micro-batches, for this attention
    role; returns it. ``dbo_min_tokens`` of the AFD config, "auto" by default: on
    CUDA the break-even of :func:`break_even_tokens`, or no split at all when the
    connector says the FFN rank computes on this GPU too (``shares_device``: the two
    roles then draw on the same SMs and memory, so there is nothing to overlap and
    the split's second read of the weights is pure loss); on the CPU 0. Also warns
    when ``--enable-dbo`` changed the model runner (:func:`runner_note`)."""
    global _min_tokens
    if not enabled(vllm_config):
        _min_tokens = 0
        return 0
    note = runner_note(vllm_config)
    if note is not None:
        logger.warning("%s", note)
    cfg = vllm_config.afd_config
    device = getattr(vllm_config.device_config, "device_type", "cpu")
    if cfg.dbo_min_tokens != "auto":
        _min_tokens, why = int(cfg.dbo_min_tokens), "dbo_min_tokens of the AFD config"
    elif device != "cuda":
        _min_tokens, why = 0, "auto on the CPU: vLLM's DBO thresholds alone"
    elif shares_device:
        _min_tokens = NEVER
        logger.info(
            "AFD attention role: DBO splits no step: the FFN rank computes on this GPU too "
            "(auto; set dbo_min_tokens to split anyway)%s",
            "; it still runs model runner V1, see the warning above" if note else "",
        )
        return _min_tokens
    else:
        experts, top_k = moe_shape(vllm_config.model_config.hf_config)
        weight_bytes = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
        _min_tokens = break_even_tokens(experts, top_k, weight_bytes, CUDA_FLOPS_PER_BYTE)
        why = (
            f"auto: FFN weights stop bounding a micro-batch at {_min_tokens // 2} tokens "
            f"({experts} experts, top-{top_k}, {weight_bytes}-byte weights, "
            f"{CUDA_FLOPS_PER_BYTE:g} FLOP/byte)"
        )
    logger.info(
        "AFD attention role: DBO splits steps of at least %d tokens (%s); smaller steps run whole",
        _min_tokens,
        why,
    )
    return _min_tokens


def min_ubatch_tokens() -> int:
    return _min_tokens


def should_ubatch(
    parallel_config: Any,
    num_tokens: int,
    uniform_decode: bool,
    allow: bool,
    num_tokens_padded: int | None = None,
) -> bool:
    """The split decision that data-parallel coordination makes in vLLM, for one
    rank: at least the DBO token threshold, and no empty last micro-batch (the
    split point is half of the CUDA-graph padded count ``num_tokens_padded``).
    Prefill and decode steps follow vLLM's two DBO token thresholds, on the CPU
    and on CUDA (where split FLASH_ATTN steps need patch ``ubatch-metadata-cache``). AFD adds its own
    floor, :func:`configure`: below it a split costs more than it can win."""
    from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds, is_last_ubatch_empty

    n = parallel_config.num_ubatches
    if not allow or num_tokens < max(n, _min_tokens):
        return False
    if num_tokens_padded is not None and is_last_ubatch_empty(num_tokens, num_tokens_padded, n):
        return False
    return check_ubatch_thresholds(parallel_config, num_tokens, uniform_decode)


def maybe_wrap(model: Any, vllm_config: Any, device: torch.device) -> Any:
    """The CPU model runner's model, wrapped for micro-batched steps when DBO is on."""
    if not enabled(vllm_config) or device.type != "cpu":
        return model
    logger.info(
        "AFD attention role: DBO on, %d micro-batches per step from %d decode / %d prefill "
        "tokens on",
        vllm_config.parallel_config.num_ubatches,
        vllm_config.parallel_config.dbo_decode_token_threshold,
        vllm_config.parallel_config.dbo_prefill_token_threshold,
    )
    return CPUUBatchWrapper(model, vllm_config)


class CPUUBatchWrapper:
    """Runs a micro-batched step (``forward_context.ubatch_slices`` set by the
    runner) as one thread per micro-batch; any other step runs as is."""

    def __init__(self, runnable: Any, vllm_config: Any):
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.ubatched_steps = 0
        self._ctx_cls = compat.cpu_context_class()

    def __getattr__(self, key: str):
        # Only reached for attributes the wrapper does not have itself.
        if key == "runnable":
            raise AttributeError(key)
        return getattr(self.runnable, key)

    def unwrap(self) -> Any:
        return self.runnable

    def __call__(self, *args, **kwargs):
        from vllm.forward_context import get_forward_context

        fc = get_forward_context()
        slices = fc.ubatch_slices
        if slices is None:
            return self.runnable(*args, **kwargs)
        return self._run(fc, slices, kwargs)

    def _run(self, fc, slices, kwargs):
        from vllm.forward_context import create_forward_context, override_forward_context

        n = len(slices)
        note_ubatch_tokens(slices)
        attn = fc.attn_metadata
        slot = fc.slot_mapping if isinstance(fc.slot_mapping, list) else None
        contexts = []
        events = [threading.Event() for _ in range(n)]
        abort = threading.Event()
        ready_barrier = threading.Barrier(n + 1)  # the micro-batch threads and this one
        for i in range(n):
            forward = create_forward_context(
                attn[i] if attn is not None else None,
                self.vllm_config,
                batch_descriptor=fc.batch_descriptor,
                slot_mapping=slot[i] if slot else None,
                additional_kwargs=dict(fc.additional_kwargs),
            )
            contexts.append(
                self._ctx_cls(
                    id=i,
                    comm_stream=None,
                    compute_stream=None,
                    forward_context=forward,
                    ready_barrier=ready_barrier,
                    cpu_wait_event=events[i],
                    cpu_signal_event=events[(i + 1) % n],
                    gpu_comm_done_event=None,
                    gpu_compute_done_event=None,
                )
            )
            contexts[-1].abort = abort
        compat.register_contexts(n)

        inputs = []
        for s in slices:
            t = s.token_slice
            positions = kwargs["positions"]
            inputs.append(
                dict(
                    input_ids=None if kwargs.get("input_ids") is None else kwargs["input_ids"][t],
                    positions=positions[:, t] if positions.ndim == 2 else positions[t],
                    intermediate_tensors=None
                    if kwargs.get("intermediate_tensors") is None
                    else kwargs["intermediate_tensors"][t],
                    inputs_embeds=None
                    if kwargs.get("inputs_embeds") is None
                    else kwargs["inputs_embeds"][t],
                )
            )
        results: list = [None] * n
        errors: list[BaseException] = []

        def body(i: int) -> None:
            try:
                with torch.inference_mode(), contexts[i]:
                    results[i] = self.runnable(**inputs[i])
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                errors.append(e)
                # The other micro-batches end at their next hand-over.
                abort.set()

        with override_forward_context(None):
            threads = [
                threading.Thread(target=body, args=(i,), name=f"afd-ubatch-{i}", daemon=True)
                for i in range(n)
            ]
            for t in threads:
                t.start()
            ready_barrier.wait()
            contexts[0].cpu_wait_event.set()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        self.ubatched_steps += 1
        return compat.merge_v1_outputs(results)
