"""The AFD micro-batch wrapper for the CPU (vllm.afd.dbo): the hand-over order of the
micro-batch threads at dbo_yield (the remote-FFN op's yield point), the output, a
failing micro-batch, and the split decision. The CPU oracle
(tests/cpu/test_afd_oracle.py::test_oracle_dbo) runs it inside vLLM."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from vllm.afd import dbo
from vllm.config.afd import AFDConfig
from vllm.v1.worker import ubatching
from vllm.v1.worker.ubatch_utils import UBatchSlice


def _vllm_config(role="attention", enable_dbo=True, decode=2, prefill=4):
    return SimpleNamespace(
        afd_config=AFDConfig.from_dict({"role": role}),
        parallel_config=SimpleNamespace(
            enable_dbo=enable_dbo, use_ubatching=enable_dbo, num_ubatches=2,
            dbo_decode_token_threshold=decode, dbo_prefill_token_threshold=prefill,
        ),
        compilation_config=SimpleNamespace(fast_moe_cold_start=False,
                                           static_forward_context={}),
    )


def _forward_context():
    return SimpleNamespace(attn_metadata=None, slot_mapping={}, batch_descriptor=None,
                           additional_kwargs={})


def _slices(*sizes):
    out, start = [], 0
    for i, n in enumerate(sizes):
        out.append(UBatchSlice(slice(i, i + 1), slice(start, start + n)))
        start += n
    return out


def _inputs(n):
    return dict(input_ids=torch.arange(n), positions=torch.arange(n),
                intermediate_tensors=None, inputs_embeds=None)


def test_micro_batches_hand_over_at_each_yield_and_outputs_concatenate():
    log = []

    def model(input_ids, positions, intermediate_tensors, inputs_embeds):
        ub = ubatching.dbo_current_ubatch_id()
        for layer in range(3):
            log.append((ub, layer))
            ubatching.dbo_yield()
        return input_ids.float() * 10 + ub

    w = dbo.CPUUBatchWrapper(model, _vllm_config())
    out = w._run(_forward_context(), _slices(3, 2), _inputs(5))
    assert log == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert out.tolist() == [0.0, 10.0, 20.0, 31.0, 41.0]
    assert w.ubatched_steps == 1
    assert not ubatching.dbo_enabled()  # no micro-batch context left behind


def test_a_failing_micro_batch_ends_the_step_without_a_hang():
    def model(input_ids, positions, intermediate_tensors, inputs_embeds):
        ub = ubatching.dbo_current_ubatch_id()
        ubatching.dbo_yield()
        if ub == 0:
            raise RuntimeError("lost AFD peer FFN rank 0")
        for _ in range(3):
            ubatching.dbo_yield()
        return input_ids.float()

    w = dbo.CPUUBatchWrapper(model, _vllm_config())
    before = threading.active_count()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="lost AFD peer FFN rank 0"):
        w._run(_forward_context(), _slices(2, 2), _inputs(4))
    assert time.monotonic() - t0 < 5
    assert threading.active_count() == before
    assert not ubatching.dbo_enabled()


def test_a_step_without_slices_runs_as_is(monkeypatch):
    import vllm.forward_context as fc

    monkeypatch.setattr(fc, "get_forward_context",
                        lambda: SimpleNamespace(ubatch_slices=None))
    w = dbo.CPUUBatchWrapper(lambda **kw: kw["input_ids"] + 1, _vllm_config())
    assert w(**_inputs(3)).tolist() == [1, 2, 3]
    assert w.ubatched_steps == 0


@pytest.mark.parametrize(
    "num_tokens, uniform_decode, allow, decode_threshold, expected",
    [
        (2, True, True, 2, True),
        (1, True, True, 2, False),  # below the decode threshold
        (1, True, True, 0, False),  # one token: there is no second micro-batch
        (3, False, True, 2, False),  # prefill threshold 4
        (4, False, True, 2, True),
        (64, True, False, 2, False),  # the runner did not allow it (e.g. a capture)
    ],
)
def test_split_decision(num_tokens, uniform_decode, allow, decode_threshold, expected):
    pc = _vllm_config(decode=decode_threshold).parallel_config
    assert dbo.should_ubatch(pc, num_tokens, uniform_decode, allow) is expected


def test_no_split_when_padding_would_leave_the_last_micro_batch_empty():
    pc = _vllm_config(decode=2).parallel_config
    assert dbo.should_ubatch(pc, 3, True, True, num_tokens_padded=4) is True  # 2 + 1 real
    assert dbo.should_ubatch(pc, 3, True, True, num_tokens_padded=8) is False  # 4 + 0 real
    assert dbo.should_ubatch(pc, 3, True, True) is True  # eager: no padding


def test_only_the_attention_role_with_dbo_is_wrapped():
    model = object()
    cpu = torch.device("cpu")
    assert isinstance(dbo.maybe_wrap(model, _vllm_config(), cpu), dbo.CPUUBatchWrapper)
    assert dbo.maybe_wrap(model, _vllm_config(enable_dbo=False), cpu) is model
    assert dbo.maybe_wrap(model, _vllm_config(role="ffn"), cpu) is model
    assert dbo.maybe_wrap(model, SimpleNamespace(afd_config=None), cpu) is model
    assert dbo.replaces_all2all(_vllm_config()) and not dbo.replaces_all2all(SimpleNamespace())


def test_a_failed_micro_batch_thread_on_cuda_ends_the_engine_with_its_error(monkeypatch):
    import threading

    from vllm.afd import failure

    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # quiet, restored after
    monkeypatch.setattr(dbo, "_hook_installed", False)
    ended, recorded = [], []
    monkeypatch.setattr(dbo, "on_ubatch_failure", ended.append)
    monkeypatch.setattr(failure, "record", lambda role, rank, msg: recorded.append((role, rank)))
    cpu = _vllm_config()
    cpu.device_config = SimpleNamespace(device=torch.device("cpu"))
    assert dbo.watch_ubatch_threads(cpu, 0) is False  # the CPU wrapper has its own abort
    cuda = _vllm_config()
    cuda.device_config = SimpleNamespace(device=torch.device("cuda"))
    assert dbo.watch_ubatch_threads(cuda, 3) is True

    def fail():
        raise RuntimeError("batch_size must be equal to batch_size_k")

    for name in ("Thread-7 (_ubatch_thread)", "Thread-8 (other)"):
        t = threading.Thread(target=fail, name=name)
        t.start()
        t.join()
    assert ended == ["DBO micro-batch thread failed: RuntimeError: batch_size must be equal to "
                     "batch_size_k"]
    assert recorded == [("attention", 3)]  # the other thread's error is not an AFD failure
