"""When the AFD attention role splits a step into micro-batches (vllm.afd.dbo): the
break-even of the FFN cost model, the model shapes it reads, the config key, and the
floor it puts under vLLM's DBO thresholds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.afd import dbo
from vllm.config.afd import AFDConfig, AFDConfigError


class _Config(SimpleNamespace):
    """A VllmConfig's fields that vllm.afd.dbo reads. ``v2_default``: the model runner
    vLLM picks for the model is V2, unless DBO is on (as 0.26.0 does for DeepSeek-V2)."""

    v2_default = False

    @property
    def use_v2_model_runner(self) -> bool:
        return self.v2_default and not self.parallel_config.enable_dbo


def _vllm_config(device="cuda", dbo_min_tokens="auto", hf=None, dtype=torch.bfloat16):
    hf = hf or SimpleNamespace(n_routed_experts=64, num_experts_per_tok=6)
    return _Config(
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


class _Log:
    """Records what vllm.afd.dbo logs (vLLM's loggers do not reach caplog)."""

    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def info(self, msg, *args):
        self.lines.append(("info", msg % args))

    def warning(self, msg, *args):
        self.lines.append(("warning", msg % args))


def test_configure_warns_when_dbo_moved_the_model_to_runner_v1(monkeypatch):
    """A server with --enable-dbo whose model vLLM runs on model runner V2 without it
    runs V1 instead (0.26.0's V2 has no DBO): it computes differently also where DBO
    splits nothing (the FFN rank on this GPU), and says so."""
    log = _Log()
    monkeypatch.setattr(dbo, "logger", log)
    moved = _vllm_config()
    moved.v2_default = True
    assert dbo.runner_moved_by_dbo(moved)
    assert moved.parallel_config.enable_dbo  # the check leaves the configuration as it was
    assert dbo.configure(moved, shares_device=True) == dbo.NEVER
    assert log.lines[0][0] == "warning" and dbo.RUNNER_MOVED in log.lines[0][1]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in log.lines[0][1]
    assert log.lines[1][0] == "info" and "DBO splits no step" in log.lines[1][1]
    assert "still runs model runner V1" in log.lines[1][1]
    log.lines.clear()
    dbo.configure(moved, shares_device=False)  # a split server warns as well
    assert [lvl for lvl, _ in log.lines] == ["warning", "info"]
    log.lines.clear()
    assert not dbo.runner_moved_by_dbo(_vllm_config())  # V1 with or without DBO
    dbo.configure(_vllm_config(), shares_device=True)
    assert [lvl for lvl, _ in log.lines] == ["info"] and "runner" not in log.lines[0][1]


# Tiny configs of the two MoE families of the DBO oracle: vLLM's default runner (V2 or V1)
# is chosen by architecture, before any weight is read.
_DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                "q_lora_rank": 32, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
                "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 2,
                "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                "routed_scaling_factor": 2.5, "vocab_size": 128,
                "max_position_embeddings": 512}  # fmt: skip
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 128,
              "max_position_embeddings": 512}  # fmt: skip


def _engine_config(tmp_path, hf: dict, enable_dbo: bool):
    import json

    from vllm.engine.arg_utils import EngineArgs

    path = tmp_path / hf["model_type"]
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    args = EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=128,
                      enable_dbo=enable_dbo, afd_config={"role": "attention"})  # fmt: skip
    return args.create_engine_config()


def test_dbo_moves_deepseek_v2_from_vllms_runner_v2_to_v1(tmp_path, monkeypatch):
    """vLLM's own runner choice, as a CUDA host makes it (Triton there): DeepSeek-V2 runs on
    model runner V2 by default, and with --enable-dbo on V1 wherever this vLLM's V2 has no
    micro-batch runner (0.26.0); Qwen3-MoE runs V1 either way. So a DeepSeek-V2 attention
    server with --enable-dbo runs another runner than plain vLLM also where DBO splits no
    step (the FFN rank on the same GPU), while a Qwen3-MoE one runs plain's."""
    import vllm.config.vllm as vllm_config_module
    from vllm.afd import compat

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    for hf in (_DEEPSEEK_V2, _QWEN3_MOE):
        plain = _engine_config(tmp_path, hf, enable_dbo=False)
        with_dbo = _engine_config(tmp_path, hf, enable_dbo=True)
        assert with_dbo.parallel_config.enable_dbo  # the AFD attention role keeps DBO
        moved = plain.use_v2_model_runner and not with_dbo.use_v2_model_runner
        assert dbo.runner_moved_by_dbo(with_dbo) == moved, hf["model_type"]
        assert not dbo.runner_moved_by_dbo(plain)
        if not compat.HAS_V2_UBATCH_RUNNER:  # 0.26.0
            assert moved == (hf["model_type"] == "deepseek_v2"), hf["model_type"]
            assert (dbo.runner_note(with_dbo) is not None) == moved
