"""DBO of the AFD attention role on vLLM's model runner V2 (vllm.afd.dbo_v2, the only
runner of vLLM 0.34.0), with fakes of runner V2's batch descriptor, CUDA-graph manager and
UBatchRunner (the unit-test venv runs vLLM 0.26.0): the split decision of a step at
data-parallel size 1, the runner's AFD additions (the micro-batch token counts for the
connector, a failed micro-batch ends the engine), and that upstream's private micro-batch
names stay in vllm.afd.compat. The GPU oracle
(tests/gpu/test_gpu_oracle.py::test_gpu_oracle_dbo) runs it inside vLLM 0.34.0."""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm.afd import compat, dbo, dbo_v2
from vllm.config import CUDAGraphMode
from vllm.config.afd import AFDConfig
from vllm.v1.worker.ubatch_utils import UBatchSlice

OVERLAY = Path(__file__).resolve().parents[3] / "overlay"


@dataclasses.dataclass(frozen=True)
class Desc:
    """The fields of runner V2's BatchExecutionDescriptor (vllm 0.34.0)."""

    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1


class Graphs:
    """Runner V2's CudaGraphManager.dispatch over a set of captured FULL graphs."""

    def __init__(self, *captured: Desc):
        self.captured = captured
        self.calls: list[tuple] = []

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras,
                 max_query_len=None, num_ubatches=1):  # fmt: skip
        self.calls.append((num_reqs, num_tokens, uniform_token_count, num_ubatches))
        for d in self.captured:
            if d.num_ubatches == num_ubatches and d.num_tokens >= num_tokens:
                return d
        return Desc(CUDAGraphMode.NONE, num_tokens, num_reqs, num_ubatches=num_ubatches)


def _parallel(decode=2, prefill=4):
    return SimpleNamespace(
        enable_dbo=True,
        use_ubatching=True,
        num_ubatches=2,
        dbo_decode_token_threshold=decode,
        dbo_prefill_token_threshold=prefill,
    )


def _dispatch(desc, graphs, num_tokens, uniform_decode=True, parallel=None):
    return dbo_v2.dispatch(
        desc, graphs, parallel or _parallel(), num_reqs=num_tokens, num_tokens=num_tokens,
        uniform_token_count=1 if uniform_decode else None, uniform_decode=uniform_decode,
    )  # fmt: skip


FULL4 = Desc(CUDAGraphMode.FULL, 4, 4, uniform_token_count=1)
FULL4_UB = dataclasses.replace(FULL4, num_ubatches=2)
FULL8 = Desc(CUDAGraphMode.FULL, 8, 8, uniform_token_count=1)
FULL8_UB = dataclasses.replace(FULL8, num_ubatches=2)


def test_a_step_below_the_thresholds_runs_whole():
    graphs = Graphs(FULL4_UB)
    assert _dispatch(FULL4, graphs, 1) is FULL4  # decode threshold 2
    eager = Desc(CUDAGraphMode.NONE, 3, 1)
    assert _dispatch(eager, graphs, 3, uniform_decode=False) is eager  # prefill threshold 4
    assert graphs.calls == []


def test_a_decode_step_with_a_micro_batched_graph_replays_it():
    graphs = Graphs(FULL4_UB)
    assert _dispatch(FULL4, graphs, 4) is FULL4_UB
    assert graphs.calls == [(4, 4, 1, 2)]
    assert _dispatch(FULL4, graphs, 3) is FULL4_UB  # padded to 4: micro-batches of 2 and 1 real


def test_a_graph_whose_last_micro_batch_would_be_padding_only_replays_the_whole_step():
    # 3 tokens padded to the 8-token graph: micro-batch 1 (tokens 4-7) holds no real token.
    graphs = Graphs(FULL8_UB)
    assert _dispatch(FULL8, graphs, 3) is FULL8


def test_a_graph_step_without_a_micro_batched_graph_replays_its_own():
    assert _dispatch(FULL4, Graphs(), 4) is FULL4


def test_an_eager_step_is_split_eagerly():
    eager = Desc(CUDAGraphMode.NONE, 6, 2, max_query_len=5, num_active_loras=0)
    graphs = Graphs(FULL8_UB)
    out = _dispatch(eager, graphs, 6, uniform_decode=False)
    assert out == Desc(CUDAGraphMode.NONE, 6, 6, uniform_token_count=None, max_query_len=None,
                       num_ubatches=2)  # fmt: skip
    assert graphs.calls == []  # a step dispatched eagerly (say the profile run) stays eager
    # No CUDA-graph manager (the profile run before capture): eager too.
    assert _dispatch(FULL4, None, 4).num_ubatches == 2


def test_afds_floor_keeps_small_steps_whole():
    cfg = SimpleNamespace(
        afd_config=AFDConfig.from_dict({"role": "attention", "dbo_min_tokens": 6}),
        parallel_config=_parallel(), device_config=SimpleNamespace(device_type="cuda"),
        use_v2_model_runner=True,
    )  # fmt: skip
    try:
        assert dbo.configure(cfg) == 6
        assert _dispatch(FULL4, Graphs(FULL4_UB), 4) is FULL4
        assert _dispatch(FULL8, Graphs(FULL8_UB), 8) is FULL8_UB
    finally:
        dbo.configure(SimpleNamespace(afd_config=None, parallel_config=None))


class FakeUBatchRunner:
    """Runner V2's UBatchRunner contract: begin_capturable_run starts the micro-batch
    threads and returns the callback that runs them and merges their outputs."""

    def __init__(self, vllm_config, device, model_state, attn_groups, kv_cache_config,
                 max_num_reqs):  # fmt: skip
        self.args = (vllm_config, device, model_state, attn_groups, kv_cache_config,
                     max_num_reqs)  # fmt: skip

    def begin_capturable_run(self, model, model_inputs, ubatch_state, for_capture=False):
        def finish():
            outs = [model(input_ids=model_inputs["input_ids"][s.token_slice])
                    for s in ubatch_state.slices]  # fmt: skip
            return torch.cat(outs)

        return finish

    def run(self, model, model_inputs, ubatch_state):
        return self.begin_capturable_run(model, model_inputs, ubatch_state)()


def _state(*sizes):
    slices, start = [], 0
    for i, n in enumerate(sizes):
        slices.append(UBatchSlice(slice(i, i + 1), slice(start, start + n)))
        start += n
    return SimpleNamespace(slices=slices, forward_contexts=[None] * len(sizes))


def _cuda_config():
    return SimpleNamespace(
        afd_config=AFDConfig.from_dict({"role": "attention"}),
        parallel_config=_parallel(),
        device_config=SimpleNamespace(device=torch.device("cuda")),
    )


def test_the_runner_tells_the_connector_the_micro_batch_token_counts():
    cls = dbo_v2.runner_class(FakeUBatchRunner)
    assert dbo_v2.runner_class(FakeUBatchRunner) is cls and issubclass(cls, FakeUBatchRunner)
    runner = dbo_v2.build_runner(FakeUBatchRunner, _cuda_config(), torch.device("cuda"),
                                 "model_state", [], "kv", 4)  # fmt: skip
    assert runner.args[1:] == (torch.device("cuda"), "model_state", [], "kv", 4)
    seen = []

    def model(input_ids):
        seen.append(dbo.step_ubatch_tokens())
        return input_ids * 10

    out = runner.run(model, {"input_ids": torch.arange(5)}, _state(3, 2))
    assert out.tolist() == [0, 10, 20, 30, 40]
    assert seen == [[3, 2], [3, 2]]  # noted before the micro-batches run


def test_model_runner_v2_dbo_is_refused_off_cuda():
    with pytest.raises(ValueError, match="CUDA only.*drop --enable-dbo"):
        dbo_v2.build_runner(FakeUBatchRunner, _cuda_config(), torch.device("cpu"), 0, 0, 0, 0)


def test_a_failed_micro_batch_ends_the_engine_with_its_error(monkeypatch):
    from vllm.afd import failure

    monkeypatch.setattr(threading, "excepthook", threading.excepthook)  # restored after
    monkeypatch.setattr(dbo, "_hook_installed", False)
    monkeypatch.setattr(dbo, "_rank", 0)  # restored after
    ended, recorded = [], []
    monkeypatch.setattr(dbo, "on_ubatch_failure", ended.append)
    monkeypatch.setattr(failure, "record", lambda role, rank, msg: recorded.append((role, rank)))
    assert dbo.watch_ubatch_threads(_cuda_config(), 3)

    def model(input_ids):
        raise RuntimeError("batch_size must be equal to batch_size_k")

    runner = dbo_v2.runner_class(FakeUBatchRunner)(*range(6))
    with pytest.raises(RuntimeError, match="batch_size_k"):  # the runner still sees it
        runner.run(model, {"input_ids": torch.arange(4)}, _state(2, 2))
    assert ended == ["DBO micro-batch failed: RuntimeError: batch_size must be equal to "
                     "batch_size_k"]  # fmt: skip
    assert recorded == [("attention", 3)]


def test_the_attention_role_reads_its_micro_batch_from_the_step_it_noted(monkeypatch):
    monkeypatch.setattr(compat, "ubatch_id", lambda: None)
    assert dbo.current_ubatch() == (0, 0)
    monkeypatch.setattr(compat, "ubatch_id", lambda: 1)
    dbo.note_ubatch_tokens(_state(3, 2).slices)
    assert dbo.current_ubatch() == (1, 2)
    monkeypatch.setattr(dbo, "_step_tokens", None)
    with pytest.raises(RuntimeError, match="note_ubatch_tokens"):
        dbo.current_ubatch()


def test_the_cpu_wrapper_says_what_to_do_without_model_runner_v1(monkeypatch):
    assert compat.HAS_V1_RUNNER  # the unit-test venv runs vLLM 0.26.0
    assert compat.merge_v1_outputs([torch.ones(1), torch.zeros(2)]).tolist() == [1, 0, 0]
    monkeypatch.setattr(compat, "HAS_V1_RUNNER", False)
    with pytest.raises(RuntimeError, match="model runner V1.*drop --enable-dbo"):
        compat.merge_v1_outputs([torch.ones(1)])


def test_upstream_private_names_stay_in_the_compat_module():
    private = re.compile(
        r"ubatching\._[A-Za-z]|_cat_ubatch_outputs|gpu_ubatch_wrapper|_fse_fuse_gate"
        r"|_ExperimentalConfig|forward_context\._forward_context|def _cpu_yield"
        r"|def _(signal|wait)_(comm|compute)_done"
    )
    found = [
        f"{p.relative_to(OVERLAY)}:{n}"
        for p in sorted(OVERLAY.rglob("*.py"))
        if p.name != "compat.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == []


def test_every_runner_v2_hook_patch_calls_what_dbo_v2_offers():
    import inspect

    root = OVERLAY.parent
    patches = sorted(root.glob("targets/*/patches/*-worker-DBO-on-model-runner-V2-*.patch"))
    assert {p.parts[-3] for p in patches} >= {"0.32.0", "0.33.0", "0.34.0"}
    params = set(inspect.signature(dbo_v2.dispatch).parameters)
    for p in patches:
        added = "\n".join(line[1:] for line in p.read_text().splitlines() if line.startswith("+ "))
        assert "dbo_v2.build_runner(" in added and "afd_dbo.enabled(vllm_config)" in added, p
        call = added.split("dbo_v2.dispatch(", 1)[1].split(")", 1)[0]
        assert set(re.findall(r"(\w+)=", call)) <= params, p
