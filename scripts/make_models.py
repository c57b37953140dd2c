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

# name -> (config overrides, dtype). All CPU models are float32.
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


def tensor_names_and_shapes(config) -> dict[str, tuple[int, ...]]:
    """The hub-format tensor names transformers writes for this config (per-expert MoE)."""
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
    from transformers import AutoConfig

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
    config = AutoConfig.for_model(
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
