"""Write a config-only model directory (config.json + the local tokenizer) at a given shape,
for benchmarks with ``--load-format dummy`` (random weights, nothing to download).

    .venv/bin/python benchmarks/make_shape.py --preset qwen3-moe-cpu-medium --out /tmp/qwen3_moe_med
    python benchmarks/make_shape.py --preset deepseek-v2-lite --out /tmp/dsv2_lite
    python benchmarks/make_shape.py --from build/models/qwen3_moe --set '{"num_hidden_layers": 4}' \\
        --out /tmp/shape

A preset names a checkpoint of ``make models`` (its tokenizer and config are the start) and the
config keys it overrides; ``--set`` overrides more keys. The tokenizer stays the small local
one: prompts use its token ids, the model's vocabulary may be larger.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")

PRESETS: dict[str, tuple[str, dict]] = {
    # The CPU DBO figures of docs/benchmarks.md: 8 MoE layers, 201 M FFN parameters.
    "qwen3-moe-cpu-medium": ("qwen3_moe", {
        "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512,
        "num_local_experts": 16, "num_experts": 16, "num_experts_per_tok": 4,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "mlp_only_layers": [],
    }),
    # DeepSeek-V2-Lite: 27 layers (layer 0 dense), hidden 2048, 64 routed experts top-6,
    # 2 shared, MLA (kv_lora_rank 512, no q LoRA).
    "deepseek-v2-lite": ("deepseek_v2_mla", {
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "num_hidden_layers": 27, "first_k_dense_replace": 1, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 102400, "max_position_embeddings": 4096,
    }),
}


def make_shape(src: Path, out: Path, overrides: dict) -> Path:
    config = src / "config.json"
    if not config.is_file():
        raise SystemExit(f"{src}: no config.json (run `make models` first?)")
    cfg = json.loads(config.read_text())
    unknown = sorted(set(overrides) - set(cfg) - {"num_experts"})
    if unknown:
        raise SystemExit(f"{src}/config.json has no key(s) {unknown}: check the spelling")
    cfg.update(overrides)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--from", dest="src", help="checkpoint dir to start from (default: the "
                   "preset's, under --models)")
    p.add_argument("--models", default="build/models", help="where `make models` wrote them")
    p.add_argument("--set", default="{}", help="JSON object of more config overrides")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if not a.preset and not a.src:
        p.error("give --preset or --from")
    try:
        extra = json.loads(a.set)
    except json.JSONDecodeError as e:
        p.error(f"--set is not JSON: {e}")
    if not isinstance(extra, dict):
        p.error("--set must be a JSON object")
    base, overrides = PRESETS[a.preset] if a.preset else (None, {})
    src = Path(a.src) if a.src else Path(a.models) / base
    out = make_shape(src, Path(a.out), {**overrides, **extra})
    print(f"wrote {out}/config.json ({len(overrides) + len(extra)} keys over {src})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
