"""One vLLM engine in this process, for the CPU oracle tests.

    python afd_proc.py plain     --model DIR --prompts FILE --out FILE
    python afd_proc.py attention --model DIR --prompts FILE --out FILE --afd JSON
    python afd_proc.py ffn       --model DIR --afd JSON

``plain`` and ``attention`` generate greedily and write JSON (token ids and
top-k logprobs per prompt), with ``--start-when FILE`` once FILE exists; ``ffn``
serves until SIGTERM/SIGINT or until its serve loop fails (exit code 3, the error
on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time


def engine_kwargs(args) -> dict:
    kw = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=not (args.compile or args.compilation_config),
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        seed=0,
        enable_prefix_caching=False,
    )
    if args.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
    if args.enable_expert_parallel:
        kw["enable_expert_parallel"] = True
    if args.gpu_memory_utilization:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.mamba_ssm_cache_dtype:
        kw["mamba_ssm_cache_dtype"] = args.mamba_ssm_cache_dtype
    if args.afd:
        kw["afd_config"] = json.loads(args.afd)
    if args.compilation_config:
        kw["compilation_config"] = json.loads(args.compilation_config)
    if args.enable_dbo:
        kw["enable_dbo"] = True
        kw["dbo_decode_token_threshold"] = args.dbo_threshold
        kw["dbo_prefill_token_threshold"] = args.dbo_prefill_threshold or args.dbo_threshold
        if "afd_config" in kw:
            # The oracle checks micro-batched steps: split from the threshold on, also
            # where AFD's cost floor (dbo_min_tokens "auto") would keep them whole.
            kw["afd_config"].setdefault("dbo_min_tokens", 0)
    return kw


START_WHEN_TIMEOUT_S = 600.0


def wait_for_file(path: str, timeout: float) -> None:
    """Says AFD-PROC-READY, then waits for ``path`` to exist (a test starts the generation
    of several engines at once so); exits 4 after ``timeout`` s."""
    print("AFD-PROC-READY", flush=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"afd_proc: {path} did not appear within {timeout:g} s", file=sys.stderr)
            sys.exit(4)
        time.sleep(0.01)


def generate(args) -> int:
    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    t_start = time.perf_counter() - t0
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, logprobs=args.logprobs, ignore_eos=True)
        for n in spec["max_tokens"]
    ]
    if args.start_when:
        wait_for_file(args.start_when, START_WHEN_TIMEOUT_S)
    print("AFD-PROC-GENERATING", flush=True)
    write_round(llm, spec, params, args.out, {"start_s": t_start})
    if args.again_when:
        print("AFD-PROC-ROUND-DONE", flush=True)
        wait_for_file(args.again_when, START_WHEN_TIMEOUT_S)
        print("AFD-PROC-GENERATING-AGAIN", flush=True)
        write_round(llm, spec, params, args.again_out, {})
    return 0


def write_round(llm, spec: dict, params, out: str, head: dict) -> None:
    """Generate ``spec``'s prompts once and write the outputs (tokens, top logprobs)."""
    t1 = time.perf_counter()
    outs = llm.generate(spec["prompts"], params, use_tqdm=False)
    result = {**head, "generate_s": time.perf_counter() - t1, "outputs": []}
    for o in outs:
        comp = o.outputs[0]
        lps = [{str(k): v.logprob for k, v in lp.items()} for lp in comp.logprobs or []]
        result["outputs"].append({"token_ids": list(comp.token_ids), "text": comp.text,
                                  "logprobs": lps})
    with open(out, "w") as f:
        json.dump(result, f)


def serve_ffn(args) -> int:
    from vllm import LLM
    from vllm.afd import ffn_runner

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    llm = LLM(**engine_kwargs(args))  # keep a reference: dropping it shuts the engine down
    if args.tensor_parallel_size > 1:
        return serve_ffn_group(args, llm, stop)
    runner = ffn_runner.ACTIVE[-1]
    print("AFD-FFN-READY", flush=True)
    while not stop.wait(0.2):
        if runner.error is not None:
            print(f"AFD-FFN-FAILED: {runner.error}", file=sys.stderr, flush=True)
            os._exit(3)
    runner.stop()
    del llm
    print(f"AFD-FFN-STOPPED steps={runner.steps_served} batched={runner.batched_steps} "
          f"ubatched={runner.ubatched_steps} pingpong={runner.pingpong_steps} "
          f"graphs={runner.graph_replays} layer_graphs={runner.layer_graph_replays}", flush=True)
    os._exit(0)


def _group_stats(worker) -> dict:
    r = worker.model_runner
    return {"rank": r.rank, "steps": r.steps_served, "group_steps": r.group_steps,
            "error": r.error}


def serve_ffn_group(args, llm, stop: threading.Event) -> int:
    """An FFN group: the FFN ranks are the engine's tensor-parallel worker
    processes; a failed serve loop ends its worker and the executor then marks
    itself failed."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    ranks = sorted(s["rank"] for s in llm.collective_rpc(_group_stats))
    print(f"AFD-FFN-GROUP ranks={ranks}", flush=True)
    print("AFD-FFN-READY", flush=True)
    while not stop.wait(0.2):
        if executor.is_failed:
            print("AFD-FFN-FAILED: a worker of the FFN group died", file=sys.stderr, flush=True)
            os._exit(3)
    for s in llm.collective_rpc(_group_stats, timeout=30):
        print(f"AFD-FFN-STOPPED rank={s['rank']} steps={s['steps']} "
              f"group_steps={s['group_steps']} error={s['error']}", flush=True)
    os._exit(0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["plain", "attention", "ffn"])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts")
    p.add_argument("--out")
    p.add_argument("--afd")
    p.add_argument("--start-when", metavar="FILE",
                   help="plain/attention: generate once FILE exists (after AFD-PROC-READY)")
    p.add_argument("--again-when", metavar="FILE",
                   help="attention: after the first round, say AFD-PROC-ROUND-DONE, wait for "
                        "FILE and generate the prompts again into --again-out")
    p.add_argument("--again-out")
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--compile", action="store_true", help="torch.compile (default eager)")
    p.add_argument("--compilation-config", help="JSON for LLM(compilation_config=...); not eager")
    p.add_argument("--enable-dbo", action="store_true", help="two micro-batches per step")
    p.add_argument("--dbo-threshold", type=int, default=2,
                   help="decode and prefill token threshold for micro-batches with --enable-dbo")
    p.add_argument("--dbo-prefill-threshold", type=int, default=None,
                   help="prefill token threshold for micro-batches (default: --dbo-threshold)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--mamba-ssm-cache-dtype", default=None,
                   help="dtype of a hybrid model's recurrent state (Qwen3-Next on the CPU: float32)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ffn: an FFN group of this many ranks (one per worker)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="ffn group: split the experts expert-parallel (CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="fixed KV cache size (engines sharing a GPU): no profile-based sizing")
    args = p.parse_args()
    if args.tensor_parallel_size > 1:
        # vLLM's automatic thread binding gives each CPU worker a NUMA node of its
        # own and refuses otherwise (one node here): let the workers share cores.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if args.mode == "ffn":
        return serve_ffn(args)
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
