"""How vLLM's scheduler splits a serving workload into steps: how many steps carry a prefill
chunk (mixed steps, which FULL_DECODE_ONLY CUDA graphs do not cover: they run without a
graph) and how many are pure decode (replayed from a graph, padded up to a capture size).

A serving figure is only as good as this split: with ``--max-num-batched-tokens`` equal to
``--max-num-seqs`` (the reference serving configuration of docs/benchmarks.md: 64 and 64, 64 requests of 64 +
256 tokens sent at once) the running requests' decode tokens take most of each step's token
budget and the waiting prompts are prefilled in ever smaller chunks, so about half of the
steps are mixed. The split depends on the scheduler only, not on the model's size, so a tiny
checkpoint on the CPU gives the step counts of the real shape::

    .venv/bin/python benchmarks/sched_steps.py --model build/models/qwen3_moe \\
        --num-prompts 64 --input-len 64 --output-len 256 --max-num-seqs 64 \\
        --max-num-batched-tokens 64

Runs plain vLLM (offline, eager, greedy, ``ignore_eos``, random prompt tokens) and counts
the scheduler's steps as they are made. Prints the counts; ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (tiny is fine)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests, all sent at once")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", help="the CPU's (the counts do not depend on it)")
    p.add_argument("--json", help="write the counts here")
    a = p.parse_args(argv)
    if min(a.num_prompts, a.input_len, a.output_len, a.max_num_seqs) < 1:
        p.error("--num-prompts, --input-len, --output-len and --max-num-seqs must be at least 1")
    if a.max_num_batched_tokens < a.max_num_seqs:
        p.error("--max-num-batched-tokens must be at least --max-num-seqs (vLLM refuses less)")
    if not Path(a.model).is_dir():
        p.error(f"--model {a.model}: not a directory")
    return a


def classify(scheduled: dict[str, int], computed_after: dict[str, int],
             prompt_len: dict[str, int]) -> dict:
    """One step: its tokens, requests, and how many of them were prefill chunks (a request
    whose computed tokens before this step were fewer than its prompt's)."""
    prefills = sum(1 for r, n in scheduled.items() if computed_after[r] - n < prompt_len[r])
    return {"tokens": sum(scheduled.values()), "requests": len(scheduled), "prefills": prefills}


def summarize(steps: list[dict], max_num_seqs: int) -> dict:
    mixed = [s for s in steps if s["prefills"]]
    decode = [s for s in steps if not s["prefills"]]
    return {
        "steps": len(steps),
        "steps_with_prefill": len(mixed),
        "pure_decode_steps": len(decode),
        "pure_decode_steps_full_batch": sum(1 for s in decode if s["requests"] == max_num_seqs),
        "mean_decode_batch": (sum(s["requests"] for s in decode) / len(decode)) if decode else 0.0,
        "tokens_in_mixed_steps": sum(s["tokens"] for s in mixed),
        "tokens_in_decode_steps": sum(s["tokens"] for s in decode),
    }


def run(a: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for these workloads
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.model, dtype=a.dtype, enforce_eager=True, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens,
              max_model_len=a.input_len + a.output_len + 16, seed=0,
              enable_prefix_caching=False)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    steps: list[dict] = []

    def counting_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        n = out.num_scheduled_tokens
        if n:
            reqs = {r: scheduler.requests[r] for r in n}
            steps.append(classify(n, {r: q.num_computed_tokens for r, q in reqs.items()},
                                  {r: q.num_prompt_tokens for r, q in reqs.items()}))
        return out

    scheduler.schedule = counting_schedule
    vocab = min(llm.llm_engine.model_config.get_vocab_size(), 1000)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(a.input_len)])
               for _ in range(a.num_prompts)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.output_len, ignore_eos=True,
                                                temperature=0.0), use_tqdm=False)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    if generated != a.num_prompts * a.output_len:
        raise SystemExit(f"generated {generated} tokens, expected "
                         f"{a.num_prompts * a.output_len}: the counts would not be the workload's")
    return summarize(steps, a.max_num_seqs)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    fig = run(a)
    print(f"{a.num_prompts} requests of {a.input_len} + {a.output_len} tokens, max_num_seqs "
          f"{a.max_num_seqs}, max_num_batched_tokens {a.max_num_batched_tokens}:")
    print(f"  steps {fig['steps']}: {fig['steps_with_prefill']} with a prefill chunk (no "
          f"FULL_DECODE_ONLY graph), {fig['pure_decode_steps']} pure decode (mean batch "
          f"{fig['mean_decode_batch']:.1f}, {fig['pure_decode_steps_full_batch']} with all "
          f"{a.max_num_seqs} sequences)")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **fig}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
