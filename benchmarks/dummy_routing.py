"""How many experts does a MoE model's router pick with dummy weights (`--load-format dummy`)?

Runs one engine (eager) on a config directory with dummy weights, generates greedy tokens for
`--batch` random prompts and records, for every call of the first MoE layer's router: the
largest |router logit|, how many distinct scores a token's softmax has in the logits' dtype
(what vLLM's grouped top-k computes for DeepSeek-V2 on CUDA) and how many distinct experts
the whole batch takes with that top-k and with a float32 softmax. Where vLLM's own routing
function runs (CUDA: `grouped_topk`, `fused_topk`) the experts it picked are counted too.

    .venv/bin/python benchmarks/make_shape.py --preset deepseek-v2-lite \\
        --set '{"num_hidden_layers": 3}' --out /tmp/dsv2l3
    .venv/bin/python benchmarks/dummy_routing.py --model /tmp/dsv2l3 --device cpu
    python3 benchmarks/dummy_routing.py --model /tmp/dsv2l3 --device cuda       # GPU host

(On the CPU the engine runs without MLA, VLLM_MLA_DISABLE=1, which the router does not see;
model runner V1, whose model the hooks reach.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="config directory (benchmarks/make_shape.py)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="greedy tokens per prompt")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args(argv)
    if a.batch < 1 or a.steps < 1 or a.input_len < 1:
        ap.error("--batch, --steps and --input-len must be at least 1")
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        ap.error(f"--model {a.model}: no config.json")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # hooks in this process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.pop("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", None)  # the checkpoint's router
    if a.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_MLA_DISABLE", "1")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    picked = count_vllm_routing()
    llm = LLM(model=a.model, load_format="dummy", enforce_eager=True, dtype="bfloat16",
              max_model_len=a.input_len + a.steps + 8, max_num_seqs=a.batch,
              max_num_batched_tokens=max(a.batch * a.input_len, 256), seed=0,
              **({"gpu_memory_utilization": 0.5} if a.device == "cuda" else {}))
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    if not gates:
        print("no MoE router (mlp.gate) in this model", file=sys.stderr)
        return 2
    hf = llm.llm_engine.model_config.hf_config
    top_k = hf.num_experts_per_tok
    experts = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_experts", "?")
    records: list[dict] = []
    gates[0].register_forward_hook(record_router(records, top_k))
    picked.clear()  # the warm-up's calls
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab - 1)
                                              for _ in range(a.input_len)])
               for _ in range(a.batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=a.steps, ignore_eos=True),
                 use_tqdm=False)
    print(f"{a.model}: {len(gates)} MoE layers, {experts} experts, top-{top_k}, "
          f"{a.batch} prompts, device {a.device}")
    print_records(records)
    # vLLM's routing function runs once per MoE layer and call
    own = picked[::len(gates)] if picked else []
    if own:
        print("vLLM's own routing, first MoE layer (tokens, distinct experts): "
              + ", ".join(f"({t}, {e})" for t, e in own))
    else:
        print("vLLM's own routing: not reached through grouped_topk/fused_topk on this "
              "device (the CPU MoE routes in its own kernel)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model": a.model, "device": a.device, "experts": experts,
                       "top_k": top_k, "router_calls": records, "vllm_routing": own}, fh,
                      indent=1)
    return 0


def count_vllm_routing() -> list[tuple[int, int]]:
    """vLLM's routing functions (grouped_topk, fused_topk) wrapped: the list they append
    (tokens, distinct experts) to on each call."""
    import torch

    import vllm.model_executor.layers.fused_moe.router.fused_topk_router as ftr
    import vllm.model_executor.layers.fused_moe.router.grouped_topk_router as gtr

    picked: list[tuple[int, int]] = []

    def counting(fn):
        def wrapper(*args, **kw):
            out = fn(*args, **kw)
            ids = out[1]
            picked.append((int(ids.shape[0]), int(torch.unique(ids).numel())))
            return out
        return wrapper

    gtr.grouped_topk = counting(gtr.grouped_topk)
    ftr.fused_topk = counting(ftr.fused_topk)
    return picked


def record_router(records: list[dict], top_k: int):
    """A forward hook for a router (mlp.gate) that appends a record of each call: its
    logits' size and the experts a top-k of their softmax picks (native dtype and fp32)."""
    import torch

    def hook(_mod, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        native = torch.softmax(logits, dim=-1)  # in the logits' dtype
        fp32 = torch.softmax(logits.float(), dim=-1)
        records.append({
            "tokens": int(logits.shape[0]), "dtype": str(logits.dtype).replace("torch.", ""),
            "max_abs_logit": float(logits.float().abs().max()),
            "distinct_scores_token0": int(torch.unique(native[0]).numel()),
            "experts_native_softmax": int(torch.unique(native.topk(top_k, -1).indices).numel()),
            "experts_fp32_softmax": int(torch.unique(fp32.topk(top_k, -1).indices).numel()),
        })

    return hook


def print_records(records: list[dict]) -> None:
    print(f"{'tokens':>7} {'dtype':>9} {'max|logit|':>11} {'distinct scores':>15} "
          f"{'experts (native softmax)':>24} {'experts (fp32 softmax)':>22}")
    for r in records:
        print(f"{r['tokens']:>7} {r['dtype']:>9} {r['max_abs_logit']:>11.2e} "
              f"{r['distinct_scores_token0']:>15} {r['experts_native_softmax']:>24} "
              f"{r['experts_fp32_softmax']:>22}")


if __name__ == "__main__":
    sys.exit(main())
