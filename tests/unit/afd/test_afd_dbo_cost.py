"""When the AFD attention role splits a step into micro-batches (vllm.afd.dbo): the
break-even of the FFN cost model, the model shapes it reads, the config key, and the
floor it puts under vLLM's DBO thresholds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.afd import dbo
from vllm.config.afd import AFDConfig, AFDConfigError


def _vllm_config(device="cuda", dbo_min_tokens="auto", hf=None, dtype=torch.bfloat16):
    hf = hf or SimpleNamespace(n_routed_experts=64, num_experts_per_tok=6)
    return SimpleNamespace(
        afd_config=AFDConfig.from_dict({"role": "attention", "dbo_min_tokens": dbo_min_tokens}),
        parallel_config=SimpleNamespace(
            enable_dbo=True,
            use_ubatching=True,
            num_ubatches=2,
            dbo_decode_token_threshold=2,
            dbo_prefill_token_threshold=4,
        ),
        device_config=SimpleNamespace(device_type=device),
        model_config=SimpleNamespace(hf_config=hf, dtype=dtype),
    )


@pytest.fixture(autouse=True)
def _reset_floor():
    yield
    assert dbo.configure(SimpleNamespace(afd_config=None, parallel_config=None)) == 0
    assert dbo.min_ubatch_tokens() == 0  # no AFD DBO: no floor left for the next test


def test_break_even_grows_with_experts_per_routed_token_and_weight_bytes():
    # DeepSeek-V2-Lite: 64 experts, top-6, bf16: each expert turns compute-bound at
    # 100 tokens, i.e. 1,067 tokens a step; splitting pays from twice that.
    assert dbo.break_even_tokens(64, 6, 2, 100.0) == 2 * 1067
    assert dbo.break_even_tokens(64, 6, 4, 100.0) == 2 * 2134  # fp32 weights: twice the bytes
    assert dbo.break_even_tokens(128, 6, 2, 100.0) > dbo.break_even_tokens(64, 6, 2, 100.0)
    assert dbo.break_even_tokens(1, 1, 2, 100.0) == 200  # dense MLP: every token, same weights


def test_moe_shape_reads_the_families_spellings():
    assert dbo.moe_shape(SimpleNamespace(n_routed_experts=64, num_experts_per_tok=6)) == (64, 6)
    assert dbo.moe_shape(SimpleNamespace(num_experts=128, num_experts_per_tok=8)) == (128, 8)
    assert dbo.moe_shape(SimpleNamespace(num_local_experts=8, num_experts_per_tok=2)) == (8, 2)
    nested = SimpleNamespace(text_config=SimpleNamespace(num_local_experts=16, top_k=1))
    assert dbo.moe_shape(nested) == (16, 1)
    assert dbo.moe_shape(SimpleNamespace(hidden_size=64)) == (1, 1)  # dense


def test_configure_auto_on_cuda_uses_the_cost_model_and_gates_decode_steps():
    floor = dbo.configure(_vllm_config())
    assert floor == dbo.break_even_tokens(64, 6, 2, dbo.CUDA_FLOPS_PER_BYTE)
    parallel = _vllm_config().parallel_config
    # A batch-256 decode step reads every expert whole in each micro-batch: not split.
    assert not dbo.should_ubatch(parallel, 256, True, True)
    assert dbo.should_ubatch(parallel, floor, False, True)  # prefill past the break-even


def test_configure_auto_on_the_cpu_and_explicit_values_keep_vllms_thresholds():
    assert dbo.configure(_vllm_config(device="cpu")) == 0
    parallel = _vllm_config().parallel_config
    assert dbo.should_ubatch(parallel, 4, True, True)
    assert not dbo.should_ubatch(parallel, 1, True, True)  # vLLM's own threshold still holds
    assert dbo.configure(_vllm_config(dbo_min_tokens=0)) == 0
    assert dbo.configure(_vllm_config(dbo_min_tokens=300)) == 300
    assert not dbo.should_ubatch(parallel, 299, False, True)
    assert dbo.should_ubatch(parallel, 300, False, True)


@pytest.mark.parametrize("bad", [-1, "some", 1.5, True])
def test_dbo_min_tokens_must_be_auto_or_a_count(bad):
    with pytest.raises(AFDConfigError, match="dbo_min_tokens"):
        AFDConfig.from_dict({"role": "attention", "dbo_min_tokens": bad})


def test_auto_splits_nothing_when_the_ffn_rank_shares_this_gpu():
    # One GPU, both roles (CUDA MPS): measured on an H200 a split batch-64 decode step
    # took 16.85 ms against 10.41 ms whole, and a 4,096-token prefill 0.208 s against 0.126.
    floor = dbo.configure(_vllm_config(), shares_device=True)
    parallel = _vllm_config().parallel_config
    assert floor == dbo.NEVER and not dbo.should_ubatch(parallel, 16384, False, True)
    assert dbo.configure(_vllm_config(), shares_device=False) == dbo.break_even_tokens(
        64, 6, 2, dbo.CUDA_FLOPS_PER_BYTE
    )
    assert dbo.configure(_vllm_config(dbo_min_tokens=0), shares_device=True) == 0  # explicit
