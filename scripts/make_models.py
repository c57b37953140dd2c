#!/usr/bin/env python3
"""Write tiny random-weight checkpoints for the oracle tests, deterministically.

Each model lands in ``--out DIR/<name>/`` with config.json, model.safetensors (hub tensor
names, sorted, metadata {"format": "pt"}), generation_config.json and a locally trained
byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json + special_tokens_map.json,
with a chat template). The same inputs give the same bytes on every run; a model whose stamp
(hash of this script, its spec and the library versions) matches is skipped.

Runs in the project venv (torch, transformers, tokenizers, safetensors).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

STAMP = ".afd-model-stamp"
SEED = 20261130
WEIGHT_STD = 0.08
VOCAB_TARGET = 1024
MAX_POS = 2048
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
_COMMON = dict(
    hidden_size=128,
    max_position_embeddings=MAX_POS,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
    initializer_range=0.02,
)
_QWEN3_MOE = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    intermediate_size=256,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    decoder_sparse_step=1,
    mlp_only_layers=[0],  # layer 0 dense, the rest MoE: both MLP paths are covered
    norm_topk_prob=True,
    **_ATTN,
    **_COMMON,
)
_DEEPSEEK_V2 = dict(
    model_type="deepseek_v2",
    architectures=["DeepseekV2ForCausalLM"],
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=256,
    q_lora_rank=None,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,  # non-MLA head size 32 + 32 = 64: accepted by the CPU backend
    v_head_dim=32,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    moe_layer_freq=1,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    scoring_func="softmax",
    **_COMMON,
)
# DeepSeek-V2's rope_scaling (factor 40 over 4096 positions), scaled to MAX_POS.
_DEEPSEEK_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=MAX_POS // 4,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)

# The MoE families of docs/models.md, one tiny checkpoint each (hidden 128, 8 experts or
# fewer, top-2): the layer mix, router and shared-expert shape of the family.
_EXPERTS = dict(num_experts_per_tok=2)
_FAMILIES: dict[str, dict] = {
    "mixtral": dict(
        model_type="mixtral",
        architectures=["MixtralForCausalLM"],
        num_hidden_layers=2,
        intermediate_size=64,
        num_local_experts=8,
        **_EXPERTS,
        **_ATTN,
        **_COMMON,
    ),
    # Qwen2-MoE: a shared expert scaled by its own sigmoid gate; layer 0 dense.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        num_hidden_layers=3,
        intermediate_size=256,
        num_experts=8,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=False,
        **_EXPERTS,
        **_ATTN,
        **_COMMON,
    ),
    "olmoe": dict(
        model_type="olmoe",
        architectures=["OlmoeForCausalLM"],
        num_hidden_layers=2,
        intermediate_size=64,
        num_experts=8,
        norm_topk_prob=False,
        **_EXPERTS,
        **_ATTN,
        **_COMMON,
    ),
    # GLM-4.5: first layer dense, sigmoid routing with e_score_correction_bias (random here,
    # so it changes the choice of experts), a shared expert, routed scaling.
    "glm4_moe": dict(
        model_type="glm4_moe",
        architectures=["Glm4MoeForCausalLM"],
        num_hidden_layers=3,
        intermediate_size=256,
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        num_nextn_predict_layers=0,
        **_EXPERTS,
        **_ATTN,
        **_COMMON,
    ),
    # ERNIE-4.5-MoE: first layer dense, fp32 router with e_score_correction_bias, a shared
    # expert.
    "ernie45_moe": dict(
        model_type="ernie4_5_moe",
        architectures=["Ernie4_5_MoeForCausalLM"],
        num_hidden_layers=3,
        intermediate_size=256,
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=64,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_end_index=2,
        moe_layer_interval=1,
        **_ATTN,
        **_COMMON,
    ),
    # MiniMax-M2: fp32 router, a routing bias (e_score_correction_bias), partial rotary, QK
    # norm. Softmax scoring, not the sigmoid of the released model: vLLM's CPU MoE routing
    # (fused_moe/cpu_fused_moe.py select_experts) takes sigmoid only with grouped top-k,
    # which MiniMax-M2 does not use.
    "minimax_m2": dict(
        model_type="minimax_m2",
        architectures=["MiniMaxM2ForCausalLM"],
        num_hidden_layers=2,
        intermediate_size=64,
        num_local_experts=8,
        scoring_func="softmax",
        use_routing_bias=True,
        rotary_dim=16,
        use_qk_norm=True,
        qk_norm_type="per_layer",
        **_EXPERTS,
        **_ATTN,
        **_COMMON,
    ),
    # GPT-OSS: attention sinks, sliding window on even layers, router and expert biases,
    # clamped SwiGLU (swiglu_limit).
    "gpt_oss": dict(
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        num_hidden_layers=2,
        intermediate_size=64,
        num_local_experts=8,
        sliding_window=16,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            original_max_position_embeddings=MAX_POS // 4,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
        **_EXPERTS,
        **_ATTN,
        **_COMMON,
    ),
    # Llama 4 (text): MoE every second layer (interleave step 2) with a shared expert,
    # sigmoid top-1 routing applied on the input; layer 1 without RoPE.
    "llama4": dict(
        model_type="llama4_text",
        architectures=["Llama4ForCausalLM"],
        num_hidden_layers=2,
        intermediate_size=64,
        intermediate_size_mlp=256,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 0],
        attention_chunk_size=128,  # a multiple of the CPU KV cache block (128)
        **_ATTN,
        **_COMMON,
    ),
    # Step-3 (text): one shared KV head with a low-rank query (share_q_dim, inter_norm, wq);
    # layer 0 dense, layers 1-2 MoE with a shared expert. No transformers class: vLLM's
    # config class and the tensor names of step3_tensor_shapes.
    "step3_text": dict(
        model_type="step3_text",
        architectures=["Step3TextForCausalLM"],
        num_hidden_layers=3,
        hidden_size=128,
        num_attention_heads=4,
        num_attention_groups=1,
        head_dim=32,
        share_q_dim=64,
        intermediate_size=256,
        moe_intermediate_size=64,
        moe_num_experts=8,
        moe_top_k=2,
        share_expert_dim=64,
        moe_layers_enum="1,2",
        norm_expert_weight=False,
        max_position_embedding=MAX_POS,
        max_seq_len=MAX_POS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Qwen3-Next: a linear-attention (Gated DeltaNet) layer and a full-attention layer.
    "qwen3_next": dict(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        intermediate_size=256,
        num_experts=8,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        # 128, as in Qwen3-Next itself (vLLM's CPU Gated DeltaNet kernels take 64 or 128; on a
        # CPU with AMX, vLLM 0.26.0's chunk_gated_delta_rule_cpu dies of SIGILL at 64 - plain
        # vLLM too: its oneDNN brgemm runs AMX tile instructions unconfigured)
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        **_EXPERTS,
        **_ATTN,
        **_COMMON,
    ),
}

# bfloat16 where vLLM's CPU kernels take nothing else: the CPU attention kernel reads the
# attention sinks as bf16 (csrc/cpu/cpu_attn.cpp), the CPU Gated DeltaNet asserts bf16.
_FAMILY_DTYPES = {"gpt_oss": "bfloat16", "qwen3_next": "bfloat16"}

# name -> (config overrides, dtype). CPU models are float32 unless said otherwise.
MODELS: dict[str, tuple[dict, str]] = {
    "llama": (
        dict(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            num_hidden_layers=2,
            intermediate_size=256,
            **_ATTN,
            **_COMMON,
        ),
        "float32",
    ),
    "qwen3_moe": (dict(_QWEN3_MOE, num_hidden_layers=3), "float32"),
    # same architecture, other layer count: for handshake / fingerprint mismatch tests
    "qwen3_moe_2l": (dict(_QWEN3_MOE, num_hidden_layers=2), "float32"),
    # DeepSeek-V2's own YaRN rope (scaled down). Besides covering YaRN and the mscale softmax
    # scale, it is needed on the CPU: with the default rope, vLLM's non-MLA DeepseekV2Attention
    # hands q_pe to the CPU rotary kernel as a 3D [tokens, heads, rope_dim] view, which that
    # kernel (csrc/cpu/pos_encoding.cpp: num_heads = size(-1) / head_size, token stride =
    # stride(-2)) only handles as 2D [tokens, heads * head_dim], so q is rotated wrongly and
    # vLLM differs from HF from the first token. YaRN uses DeepseekScalingRotaryEmbedding,
    # PyTorch-native on the CPU.
    "deepseek_v2": (dict(_DEEPSEEK_V2, rope_parameters=_DEEPSEEK_YARN), "float32"),
    # GPU only: shapes the MLA backends accept (kv_lora_rank 512, rope 64, nope 128, v 128).
    # bfloat16 (what the MLA kernels take) keeps it under 10 MB.
    "deepseek_v2_mla": (
        dict(
            _DEEPSEEK_V2,
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=8,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            moe_intermediate_size=64,
            intermediate_size=256,
        ),
        "bfloat16",
    ),
    # DeepSeek-V2 as the released configs have it: a low-rank query (q LoRA),
    # group-limited routing (16 experts in 4 groups, a token's top-4 from its best 2
    # groups: 8 candidates, so the group limit changes the choice), two dense first layers,
    # two shared experts and a routed scaling factor. MLA shapes the GPU backends accept
    # (as deepseek_v2_mla); the CPU runs it without MLA (head size 192) in float32, with
    # YaRN rope as deepseek_v2 needs there. bfloat16 keeps the file small (about 13 MB).
    "deepseek_v2_qlora": (
        dict(
            _DEEPSEEK_V2,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            first_k_dense_replace=2,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters=_DEEPSEEK_YARN,
        ),
        "bfloat16",
    ),
    **{name: (spec, _FAMILY_DTYPES.get(name, "float32")) for name, spec in _FAMILIES.items()},
}


def corpus() -> list[str]:
    """A fixed, built-in training text (no downloads)."""
    subjects = [
        "the model",
        "a small cat",
        "the engineer",
        "our server",
        "the attention layer",
        "every expert",
        "the scheduler",
        "a quiet river",
        "the old library",
        "this test",
    ]
    verbs = [
        "reads",
        "writes",
        "sends",
        "receives",
        "computes",
        "remembers",
        "measures",
        "splits",
        "joins",
        "checks",
    ]
    objects = [
        "the hidden states",
        "a long sentence",
        "many tokens",
        "the cache",
        "two numbers",
        "the weather",
        "a red apple",
        "the network",
        "some music",
        "the answer",
    ]
    tails = [
        "today.",
        "again and again.",
        "very quickly.",
        "before dinner.",
        "in the morning.",
        "without a sound.",
        "for the first time.",
        "on the GPU.",
        "on the CPU.",
        "at night.",
    ]
    lines = []
    for i, s in enumerate(subjects):
        for j, v in enumerate(verbs):
            o = objects[(i + j) % len(objects)]
            t = tails[(i * 3 + j) % len(tails)]
            lines.append(f"{s.capitalize()} {v} {o} {t}")
    lines += [
        "Hello, my name is Ada. What is your name?",
        "The capital of France is Paris. The capital of Italy is Rome.",
        "One, two, three, four, five, six, seven, eight, nine, ten.",
        "Question: what is 12 + 30? Answer: 42.",
        "def add(a, b):\n    return a + b\n",
        "Disaggregated attention and feed-forward networks run on different GPUs.",
        "The quick brown fox jumps over the lazy dog 0123456789 times!",
    ]
    return lines


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus() * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    # canonical JSON (sorted keys) so the bytes do not depend on hash-map iteration order
    data = json.loads(tok.to_str())
    (out / "tokenizer.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_POS,
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(special, indent=1, sort_keys=True) + "\n"
    )
    return tok.get_vocab_size(with_added_tokens=True), {
        t: tok.token_to_id(t) for t in (BOS, EOS, PAD)
    }


def step3_tensor_shapes(c) -> dict[str, tuple[int, ...]]:
    """Step-3 text's checkpoint names (those vLLM's step3_text.py loads: stacked experts)."""
    h, hd, q = c.hidden_size, c.head_dim, c.share_q_dim
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c.vocab_size, h),
    }
    moe = {int(i) for i in c.moe_layers_enum.split(",")}

    def mlp(prefix: str, inter: int) -> None:
        shapes[f"{prefix}.gate_proj.weight"] = (inter, h)
        shapes[f"{prefix}.up_proj.weight"] = (inter, h)
        shapes[f"{prefix}.down_proj.weight"] = (h, inter)

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (q, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (hd, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (hd, h)
        shapes[f"{p}.self_attn.inter_norm.weight"] = (q,)
        shapes[f"{p}.self_attn.wq.weight"] = (c.num_attention_heads * hd, q)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, c.num_attention_heads * hd)
        if i not in moe:
            mlp(f"{p}.mlp", c.intermediate_size)
            continue
        e, m = c.moe_num_experts, c.moe_intermediate_size
        shapes[f"{p}.moe.gate.weight"] = (e, h)
        shapes[f"{p}.moe.gate_proj.weight"] = (e, m, h)
        shapes[f"{p}.moe.up_proj.weight"] = (e, m, h)
        shapes[f"{p}.moe.down_proj.weight"] = (e, h, m)
        mlp(f"{p}.share_expert", c.share_expert_dim)
    return shapes


# Model types transformers has no class for: vLLM's config class, and the tensor names.
CUSTOM_TYPES = {
    "step3_text": ("vllm.transformers_utils.configs.step3_vl.Step3TextConfig", step3_tensor_shapes)
}


def make_config(model_type: str, **kwargs):
    if model_type not in CUSTOM_TYPES:
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **kwargs)
    import importlib

    module, _, cls = CUSTOM_TYPES[model_type][0].rpartition(".")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def tensor_names_and_shapes(config) -> dict[str, tuple[int, ...]]:
    """The hub-format tensor names transformers writes for this config (per-expert MoE)."""
    if config.model_type in CUSTOM_TYPES:
        return CUSTOM_TYPES[config.model_type][1](config)
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shapes = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
    return shapes


def init_tensor(name: str, shape: tuple[int, ...], dtype, model_name: str):
    import torch

    if name.endswith("norm.weight") or "layernorm" in name:
        return torch.ones(shape, dtype=torch.float32).to(dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.float32).to(dtype)
    seed = int.from_bytes(hashlib.sha256(f"{SEED}:{model_name}:{name}".encode()).digest()[:8])
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * WEIGHT_STD).to(dtype)


def spec_hash(name: str) -> str:
    import safetensors
    import tokenizers
    import torch
    import transformers

    overrides, dtype = MODELS[name]
    doc = {
        "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "spec": [overrides, dtype],
        "versions": [
            torch.__version__,
            transformers.__version__,
            tokenizers.__version__,
            safetensors.__version__,
        ],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def make_model(name: str, out_root: Path, force: bool = False) -> str:
    import torch
    from safetensors.torch import save_file

    out = out_root / name
    digest = spec_hash(name)
    if not force and (out / STAMP).is_file() and (out / STAMP).read_text().strip() == digest:
        return "up to date"
    t0 = time.monotonic()
    tmp = out_root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab, ids = build_tokenizer(tmp)

    overrides, dtype_name = MODELS[name]
    overrides = dict(overrides)
    model_type = overrides.pop("model_type")
    config = make_config(
        model_type,
        vocab_size=vocab,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        **overrides,
    )
    config.dtype = dtype_name
    cfg = config.to_dict()
    cfg.pop("transformers_version", None)
    cfg["torch_dtype"] = dtype_name
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "do_sample": False,
    }
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1, sort_keys=True) + "\n")

    dtype = getattr(torch, dtype_name)
    shapes = tensor_names_and_shapes(config)
    tensors = {k: init_tensor(k, shapes[k], dtype, name).contiguous() for k in sorted(shapes)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / STAMP).write_text(digest + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    n_params = sum(t.numel() for t in tensors.values())
    size = (out / "model.safetensors").stat().st_size / 1e6
    return (
        f"wrote {out} ({model_type}, {cfg['num_hidden_layers']} layers, {n_params / 1e6:.2f}M "
        f"params {dtype_name}, {size:.1f} MB, vocab {vocab}) [{time.monotonic() - t0:.1f}s]"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", default="build/models")
    parser.add_argument(
        "--only", action="append", choices=sorted(MODELS), help="make only this model (repeatable)"
    )
    parser.add_argument("--force", action="store_true", help="rewrite even when up to date")
    args = parser.parse_args(argv)
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(MODELS):
        msg = make_model(name, out_root, force=args.force)
        print(f"{name}: {msg}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
