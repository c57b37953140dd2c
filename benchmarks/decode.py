"""Decode benchmark: plain vLLM vs AFD (1 attention + 1 FFN rank), measured in one run.

    # CPU, tiny checkpoint, model routing and balanced routing:
    .venv/bin/python benchmarks/decode.py --model build/models/qwen3_moe --routing both
    # with the per-layer breakdown of 16 profiled decode steps of each AFD run:
    .venv/bin/python benchmarks/decode.py --model build/models/qwen3_moe --breakdown 16
    # GPU host, real shapes with dummy weights (config dir of DeepSeek-V2-Lite), AFD on
    # GPUs 0+1 with the device-only connector and FULL decode graphs, batch sweep:
    python benchmarks/decode.py --model CONFIG_DIR --load-format dummy --device cuda \\
        --dtype bfloat16 --batches 16,64,256 --input-len 64 --output-len 256 \\
        --connector cuda_ipc --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'

Per configuration (plain, then AFD; for each routing asked for) one engine warms up, then
generates ``--batch`` requests of ``--input-len`` random prompt tokens ``--repeats`` times
each with 1 output token (prefill only), with half of ``--output-len`` and with
``--output-len`` tokens (``ignore_eos``), each output step's arrival timed. TPOT is vLLM's
serving benchmark's: from the step that gave every request its first token to the last one,
over the ``output-len - 1`` steps between, the best of the full-length runs; decode
throughput is ``batch / TPOT``. The JSON also keeps each of those runs' TPOT, time to first
token and step intervals, and the earlier estimate from two lengths (``tpot_diff_s``:
the full and the half-length generation's difference over the steps between; their prefills
cancel, but the noise of both runs is divided by only half the steps). Engines run in child
processes (one per role), so each figure starts from a fresh process; plain and AFD share
the machine one after the other, never at once.

``--routing balanced`` sets ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=afd_balanced`` (expert
load spread evenly; changes outputs, benchmarks only); ``model`` uses the checkpoint's
router; ``both`` runs each. Prints a table and, with ``--json FILE``, writes the figures.

``--engines M`` runs M engines at once: AFD with M attention ranks of one FFN rank (MA1F),
``plain`` as M replicas of batch b, and ``plain_one`` as ONE plain engine of batch M x b
(the same total concurrency; its KV cache M times ``--kv-cache-memory-bytes``): what a user
with one GPU runs instead of either. The table gives every mode's throughput against the
replicas and against that one engine. ``--ffn-schedule join,pingpong,auto`` runs every AFD
mode once per FFN schedule (``connector_extra_config.ffn_schedule``, docs/ping-pong.md):
joined passes (``afd``), the ranks' steps interleaved layer by layer (``afd_pingpong``),
either per composition of ranks by measured rounds (``afd_auto``); the FFN line of each AFD
run counts the passes that joined ranks and the rounds that interleaved them.

Beside every figure the table prints the step's roofline (``vllm.afd.plan``): the bytes it
must move (the weights each process reads, the experts its tokens touch, the KV cache at
the mean context ``input + output / 2``) and its FLOPs, over the card's HBM bandwidth and
matrix peak (``--card``, by default from the engines' device name; ``--hbm-tbs`` and
``--tflops`` for another device, e.g. the CPU), and the measured step as a fraction of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

# Ports below the ephemeral range (scripts/serve_util/ports.py says why).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import mps  # noqa: E402  (benchmarks/mps.py)
import roofline  # noqa: E402  (benchmarks/roofline.py)

from serve_util import (  # noqa: E402
    cuda_visible_devices,
    dummy_routing_note,
    free_port,
    install_cleanup,
    median_run,
    parse_schedules,
    rounds_of,
    routing_env,
    schedule_extra,
    shared_gpu_note,
    split_mode,
    with_schedules,
)

BREAKDOWN_DELAY = 3  # profiled run: steps before the profiler starts (prefill included)
WARMUP_TOKENS = 8  # warm-up run: prefill and 7 decode steps (run_generate)


CPUS_ENV = "AFD_BENCH_CPUS"
# M engines at once (M attention ranks of one FFN rank, or M plain replicas): every timed
# generate() starts when all M have reached it, so that the timed windows overlap.
SYNC_DIR_ENV, SYNC_N_ENV, SYNC_RANK_ENV = "AFD_BENCH_SYNC_DIR", "AFD_BENCH_SYNC_N", "AFD_BENCH_RANK"


def barrier(phase: str, timeout: float = 600.0) -> None:
    """Wait until the M engines of this measurement have all reached ``phase`` (no-op for
    one engine). Files in a directory the driver made: ``<phase>.<rank>``."""
    sync = os.environ.get(SYNC_DIR_ENV)
    if not sync:
        return
    n, rank = int(os.environ[SYNC_N_ENV]), os.environ[SYNC_RANK_ENV]
    Path(sync, f"{phase}.{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(Path(sync).glob(f"{phase}.*"))) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"barrier {phase!r}: the other engines did not arrive within "
                             f"{timeout:g} s")
        time.sleep(0.005)


def parse_cpus(spec: str) -> list[int]:
    """'0', '0-3', '0,2-3' -> CPU ids (each must be one this process may run on)."""
    cpus: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"bad CPU list {spec!r} (expected e.g. '0', '0-3', '0,2')") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not set(cpus) <= allowed:
        raise ValueError(f"CPU list {spec!r} is not within this machine's CPUs {sorted(allowed)}")
    return cpus


def pin_to_cpus(spec: str | None) -> None:
    """Child roles: run the whole process (threads created later inherit the mask) on
    these CPUs, with as many OpenMP threads. Before torch is imported. vLLM's own
    VLLM_CPU_OMP_THREADS_BIND does not apply here: in 0.26.0 it is applied by the
    multiprocess executor, and these engines run in-process."""
    if not spec:
        return
    cpus = parse_cpus(spec)
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"


def engine_kwargs(a) -> dict:
    kw = dict(
        model=a.model,
        dtype=a.dtype,
        enforce_eager=not (a.compile or a.compilation_config),
        max_model_len=a.input_len + a.output_len + 8,
        max_num_seqs=a.batch,
        max_num_batched_tokens=max(a.batch * a.input_len, 512),
        seed=0,
        enable_prefix_caching=False,
        load_format=a.load_format,
    )
    if a.gpu_memory_utilization:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
    if a.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = a.kv_cache_memory_bytes
    if a.afd:
        kw["afd_config"] = json.loads(a.afd)
        if a.attention_rank is not None:
            kw["afd_config"]["rank"] = a.attention_rank
    if a.compilation_config:
        kw["compilation_config"] = json.loads(a.compilation_config)
    if not kw["enforce_eager"]:
        kw["compilation_config"] = graph_sizes_for(kw.get("compilation_config") or {}, a.batch)
    if a.profile_dir:
        # benchmarks/breakdown.py: traces of the same decode steps on both roles; the
        # delay skips the profiled run's prefill and first decode steps.
        kw["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": a.profile_dir,
            "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": True,
            "delay_iterations": BREAKDOWN_DELAY,
            "max_iterations": a.breakdown_steps,
        }
    if a.enable_dbo:
        kw["enable_dbo"] = True
        if a.dbo_threshold is not None:
            kw["dbo_decode_token_threshold"] = a.dbo_threshold
            kw["dbo_prefill_token_threshold"] = a.dbo_threshold
    return kw


def graph_sizes_for(cc: dict, batch: int) -> dict:
    """The compilation config of an engine of decode batch ``batch``: vLLM captures decode
    graphs up to min(2 x max_num_seqs, 512) tokens unless told, so a batch over 512 (the
    one engine of M x b) would decode without a graph where the replicas of b have one;
    this raises the largest captured size to the batch where no size was given."""
    if batch <= 512 or "max_cudagraph_capture_size" in cc or "cudagraph_capture_sizes" in cc:
        return cc
    return {**cc, "max_cudagraph_capture_size": batch}


# ------------------------------------------------------------------ child roles
class Run(NamedTuple):
    """One timed generation: its wall time and, per output step, the seconds since it began
    and the fewest tokens any request had by then."""

    wall_s: float
    stamps: list[tuple[float, int]]


def decode_times(stamps: list[tuple[float, int]], n: int) -> dict:
    """The decode of one generation of ``n`` tokens per request (``Run.stamps``): the time
    until every request had its first token, the TPOT as vLLM's serving benchmark defines
    it (first to last token over the ``n - 1`` steps between, here for the batch as a
    whole), and the intervals between those steps with their median."""
    if n < 2:
        raise ValueError("a decode needs at least 2 tokens per request")
    reached: dict[int, float] = {}
    for t, k in stamps:
        reached.setdefault(k, t)
    if sorted(k for k in reached if k >= 1) != list(range(1, n + 1)):
        raise ValueError(f"the output steps do not advance every request by one token "
                         f"each step (fewest tokens seen: {sorted(reached)})")
    times = [reached[k] for k in range(1, n + 1)]
    steps = [b - a for a, b in zip(times, times[1:])]
    return {"first_token_s": times[0], "tpot_s": (times[-1] - times[0]) / (n - 1),
            "itl_median_s": statistics.median(steps),
            "step_s": [round(x, 6) for x in steps]}


def run_generate(a) -> int:
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(**engine_kwargs(a))
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab - 1)
                                              for _ in range(a.input_len)])
               for _ in range(a.batch)]

    phases = iter(range(1_000_000))
    engine = llm.llm_engine

    def timed(n: int) -> Run:
        """Every prompt generates ``n`` tokens, through the engine's own step loop (what
        ``LLM.generate`` runs) so that each output step's arrival is timed."""
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        phase = f"run{next(phases)}"
        barrier(phase)
        t0 = time.perf_counter()
        got = {f"{phase}-{i}": 0 for i in range(len(prompts))}
        for rid, prompt in zip(got, prompts):
            engine.add_request(rid, prompt, sp)
        stamps: list[tuple[float, int]] = []
        while engine.has_unfinished_requests():
            outs = engine.step()
            if outs:
                for o in outs:
                    got[o.request_id] += len(o.outputs[0].token_ids)
                stamps.append((time.perf_counter() - t0, min(got.values())))
        wall = time.perf_counter() - t0
        assert all(k == n for k in got.values()), got
        return Run(wall, stamps)

    # Warm-up with some decode steps: an FFN rank captures a graph for a step's shape (and,
    # with several attention ranks, for each set of ranks a pass joins) when it recurs, so
    # one decode step left those captures inside the first timed run (on the H200 a 2A1F
    # run at batch 64 gave 1.05x with --repeats 1 and 1.45x as best of 2).
    timed(min(a.output_len, WARMUP_TOKENS))
    t_prefill = min(timed(1).wall_s for _ in range(a.repeats))
    half = max(1, a.output_len // 2)
    halves = [timed(half) for _ in range(a.repeats)] if half > 1 else []
    fulls = [timed(a.output_len) for _ in range(a.repeats)]
    t_half = min(r.wall_s for r in halves) if halves else t_prefill
    t_full = min(r.wall_s for r in fulls)
    runs = [decode_times(r.stamps, a.output_len) for r in fulls]
    if a.profile_dir:
        # After the timed runs: the profiler slows both roles down.
        llm.start_profile()
        timed(BREAKDOWN_DELAY + a.breakdown_steps + 3)
        llm.stop_profile()
    best = min(runs, key=lambda r: r["tpot_s"])
    Path(a.out).write_text(json.dumps({
        "device": device_name(),
        # The best full-length run's figures, and every full-length run's.
        **{k: v for k, v in best.items() if k != "step_s"}, "full_runs": runs,
        # The earlier estimate from two lengths: their prefills cancel, but the noise of
        # both runs is divided by only the steps between them.
        "tpot_diff_s": (t_full - t_half) / (a.output_len - half),
        "prefill_s": t_prefill, "half_s": t_half, "full_s": t_full}))
    return 0


def device_name() -> str:
    """The CUDA device's name (the roofline's card), "cpu" without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_ffn(a) -> int:
    import signal
    import threading

    from vllm import LLM
    from vllm.afd import ffn_runner

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    llm = LLM(**engine_kwargs(a))  # noqa: F841 - keeps the engine alive
    runner = ffn_runner.ACTIVE[-1]
    print("AFD-FFN-READY", flush=True)
    while not stop.wait(0.2):
        if runner.error is not None:
            print(f"FFN failed: {runner.error}", file=sys.stderr, flush=True)
            print_ffn_stats(runner)
            os._exit(3)
    runner.stop()
    print_ffn_stats(runner)
    os._exit(0)


# ------------------------------------------------------------------ driver
FFN_STATS = "AFD-FFN-STATS"


def print_ffn_stats(runner) -> None:
    """The share of FFN passes that joined several attention ranks (M:N's gain comes from
    those: one read of the experts for all of them), the rounds that interleaved several
    ranks' steps (ffn_schedule pingpong) and the FFN graphs captured and replayed, of
    whole steps and of single layers (ffn_layer_graphs; each capture stalls the ranks
    served); measure() reads this line."""
    print(f"{FFN_STATS} " + json.dumps({"steps_served": runner.steps_served,
                                        "batched_steps": runner.batched_steps,
                                        "pingpong_steps": runner.pingpong_steps,
                                        "split_steps": runner.split_steps,
                                        "graphs": len(runner.graphs),
                                        "graph_replays": runner.graph_replays,
                                        "layer_graphs": len(runner.layer_graphs),
                                        "layer_graph_replays": runner.layer_graph_replays}),
          flush=True)  # fmt: skip


def ffn_stats(log: Path) -> dict | None:
    """The FFN child's pass counters (its last AFD-FFN-STATS line), None if it wrote none."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if ln.startswith(FFN_STATS + " ")]
    return json.loads(lines[-1].split(" ", 1)[1]) if lines else None


def child(a, role: str, extra: list[str], env: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--_role", role, *extra]
    fh = open(log, "w")
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def engines_of(a, mode: str) -> int:
    """Engines a mode runs at once: one for ``plain_one``, ``--engines`` otherwise."""
    return 1 if mode == "plain_one" else a.engines


def engine_batch(a, mode: str, batch: int) -> int:
    """The decode batch of each engine of a mode: ``plain_one`` takes all M engines'."""
    return a.engines * batch if mode == "plain_one" else batch


def measure(a, base_args: list[str], mode: str, routing: str, work: Path, batch: int,
            rnd: int = 0) -> dict:
    """One configuration: plain (``--engines`` replicas at once), plain_one (one engine of
    ``--engines`` x batch) or AFD (one FFN rank serving ``--engines`` attention ranks) in
    round ``rnd`` (its logs and traces named apart). Per engine its TPOT; the result adds
    them up (``batch`` is the batch per replica or attention rank)."""
    afd = mode.startswith("afd")
    env = dict(os.environ)
    if a.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.update(routing_env(routing))
    tag = (f"{mode}_{routing}_b{batch}" + (f"_m{a.engines}" if a.engines > 1 else "")
           + (f"_r{rnd + 1}" if a.rounds > 1 else ""))
    want_bd = afd and a.breakdown_steps > 0
    ffn = None
    args = list(base_args)
    try:
        if afd:
            ffn, args = start_ffn(a, args, env, mode, tag, work, want_bd)
        elif a.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = a.attention_gpu
        per_engine = run_engines(a, args, env, tag, work, afd, engines_of(a, mode))
        result = combine(per_engine, engine_batch(a, mode, batch))
        if want_bd:
            try:
                result["breakdown"] = run_breakdown(
                    Path(a.trace_dir) if a.trace_dir else work, tag)
            except BreakdownError as e:
                # The run's figures stand; main() reports the failure and exits 1.
                print(f"{tag}: no breakdown: {e}", flush=True)
                result["breakdown_error"] = str(e)
        return result
    finally:
        if ffn is not None:
            ffn.terminate()
            try:
                ffn.wait(30)
            except subprocess.TimeoutExpired:
                ffn.kill()
            if (stats := ffn_stats(work / f"{tag}_ffn.log")) is not None and afd:
                print(f"  {tag}: {ffn_line(stats)}", flush=True)


def ffn_line(stats: dict) -> str:
    """What the FFN rank of an AFD run did: its passes, those that joined several attention
    ranks, the rounds that interleaved several ranks' steps, its graphs (of single layers
    too, where it captured or replayed any)."""
    line = (f"FFN passes {stats['steps_served']}, of them joining several attention ranks "
            f"{stats['batched_steps']}; rounds interleaving several ranks (pingpong) "
            f"{stats.get('pingpong_steps', 0)}; FFN graphs captured {stats['graphs']}, "
            f"replayed {stats['graph_replays']} times")
    if stats.get("layer_graphs") or stats.get("layer_graph_replays"):
        line += (f"; layer graphs captured {stats['layer_graphs']}, replayed "
                 f"{stats['layer_graph_replays']} times")
    return line


def start_ffn(a, args: list[str], env: dict, mode: str, tag: str, work: Path,
              want_bd: bool) -> tuple[subprocess.Popen, list[str]]:
    """Start the FFN rank; ``env`` becomes the attention ranks' environment and the
    returned arguments theirs (``--afd`` without the rank, added per engine)."""
    port = free_port()
    cfg = {"connector": a.connector, "host": "127.0.0.1", "port": port, "timeout_s": 300,
           "num_attention_ranks": a.engines, "num_ffn_ranks": 1}
    if extra := schedule_extra(a.connector_extra, mode):
        cfg["connector_extra_config"] = extra
    ffn_env = dict(env)
    # run_ffn reads the FFN runner of its own process (ffn_runner.ACTIVE): the
    # engine core must run in-process (on the CPU it does anyway).
    ffn_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if a.device == "cpu" and a.ffn_cpus:
        # The whole child process (every thread, the FFN serve thread's OpenMP
        # team included) on these cores; see pin_to_cpus.
        ffn_env[CPUS_ENV] = a.ffn_cpus
        env[CPUS_ENV] = a.attention_cpus
    if a.device == "cuda":
        att, ffn_gpu = a.attention_gpu, a.ffn_gpu
        ffn_env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(ffn_gpu, att, a.connector)
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(att, ffn_gpu, a.connector)
    ffn_args = [*args, "--afd", json.dumps({"role": "ffn", **cfg})]
    args = [*args, "--afd", json.dumps({"role": "attention", **cfg})]
    if want_bd:
        traces = Path(a.trace_dir) if a.trace_dir else work
        ffn_args += ["--profile-dir", str(traces / f"{tag}_trace_ffn"),
                     "--breakdown", str(a.breakdown_steps)]
        args += ["--profile-dir", str(traces / f"{tag}_trace_attention"),
                 "--breakdown", str(a.breakdown_steps)]
        # vLLM's own step spans ("gpu_model_runner: forward") delimit the steps.
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    if split_mode(mode)[0] == "afd_dbo":
        args.append("--enable-dbo")
    return child(a, "ffn", ffn_args, ffn_env, work / f"{tag}_ffn.log"), args


def run_engines(a, args: list[str], env: dict, tag: str, work: Path, afd: bool,
                engines: int) -> list[dict]:
    """``engines`` generate children at once (attention ranks 0..M-1 with AFD), their
    timed runs aligned by ``barrier``; each one's figures."""
    sync = Path(tempfile.mkdtemp(prefix="sync-", dir=work)) if engines > 1 else None
    procs = []
    for i in range(engines):
        name = tag if engines == 1 else f"{tag}_e{i}"
        e_args = [*args, "--out", str(work / f"{name}.json")]
        e_env = dict(env)
        if afd:
            e_args += ["--attention-rank", str(i)]
        if sync is not None:
            e_env.update({SYNC_DIR_ENV: str(sync), SYNC_N_ENV: str(engines),
                          SYNC_RANK_ENV: str(i)})
        procs.append((name, child(a, "generate", e_args, e_env, work / f"{name}.log")))
    deadline = time.monotonic() + a.timeout
    try:
        for name, proc in procs:
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{name}: no result within {a.timeout} s\n"
                                 + tail(work / f"{name}.log")) from None
            if rc != 0:
                extra = f"\n--- FFN ---\n{tail(work / f'{tag}_ffn.log')}" if afd else ""
                raise SystemExit(f"{name}: generation failed (rc={rc})\n"
                                 + tail(work / f"{name}.log") + extra)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [json.loads((work / f"{name}.json").read_text()) for name, _ in procs]


def combine(per_engine: list[dict], batch: int) -> dict:
    """One engine: its figures. Several: decode throughput is the sum of theirs, the times
    the mean (``engines`` keeps each one's). ``batch`` is each engine's."""
    if len(per_engine) == 1:
        return {**per_engine[0], "decode_tok_s": batch / per_engine[0]["tpot_s"]}
    n = len(per_engine)
    mean = {key: sum(r[key] for r in per_engine) / n
            for key in ("tpot_s", "itl_median_s", "tpot_diff_s", "prefill_s", "full_s")}
    return {**mean,
            "decode_tok_s": sum(batch / r["tpot_s"] for r in per_engine),
            "device": per_engine[0].get("device"),
            "engines": per_engine}


def decode_tok_s(r: dict, batch: int) -> float:
    return r.get("decode_tok_s", batch / r["tpot_s"])


def summarize(results: list[dict], batches: list[int], routings: list[str],
              modes: list[str]) -> list[dict]:
    """One row per (batch, routing, mode): its median run by decode throughput (of an even
    number of runs, the slower of the middle two), the range of its runs' TPOT, and the
    throughput against plain vLLM's median run of the same batch and routing (``vs_plain``:
    the replicas with --engines M) and against the one plain engine of M x b
    (``vs_one``); None without that run."""
    rows = []
    for batch in batches:
        for routing in routings:
            median = {}
            for mode in modes:
                runs = [r for r in results
                        if (r["batch"], r["routing"], r["mode"]) == (batch, routing, mode)]
                median[mode] = (median_run(runs, lambda r, b=batch: decode_tok_s(r, b)),
                                [r["tpot_s"] for r in runs])  # fmt: skip
            plain = decode_tok_s(median["plain"][0], batch) if "plain" in median else None
            one = (decode_tok_s(median["plain_one"][0], batch) if "plain_one" in median
                   else None)
            for mode in modes:
                run, tpots = median[mode]
                tok_s = decode_tok_s(run, batch)
                rows.append({"batch": batch, "routing": routing, "mode": mode,
                             "runs": len(tpots), "tpot_s": run["tpot_s"],
                             "tpot_min_s": min(tpots), "tpot_max_s": max(tpots),
                             "decode_tok_s": tok_s,
                             "vs_plain": tok_s / plain if plain else None,
                             "vs_one": tok_s / one if one else None})  # fmt: skip
    return rows


class BreakdownError(RuntimeError):
    pass


# Trace errors that mean "not written (completely) yet": worth waiting for.
_TRACE_PENDING = ("no torch profiler trace", "cannot read trace")


def run_breakdown(work: Path, tag: str, timeout: float = 120.0) -> dict:
    """Parse the two roles' traces of one AFD run (benchmarks/breakdown.py). The FFN rank
    writes its trace when its profiler stops; wait for it to be complete (a trace that is
    there but says nothing useful fails at once)."""
    import breakdown as bd

    att, ffn = work / f"{tag}_trace_attention", work / f"{tag}_trace_ffn"
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = bd.breakdown(att, ffn)
            break
        except bd.TraceError as e:
            if not str(e).startswith(_TRACE_PENDING) or time.monotonic() > deadline:
                raise BreakdownError(str(e)) from None
            time.sleep(1.0)
    print(bd.format_report(r), flush=True)
    return bd.as_json(r)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint or config directory")
    p.add_argument("--load-format", default="auto", help="'dummy' for real shapes, no weights")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--connector", default="gloo")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", help="comma list of batch sizes to sweep (overrides --batch)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="best of N timings")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="start every (batch, mode) engine N times, the modes' order reversed "
                        "every other round; the table gives each mode's median run (by "
                        "throughput) and the range of the runs' TPOT")
    p.add_argument("--routing", choices=["model", "balanced", "both"], default="model")
    p.add_argument("--modes", default=None,
                   help="comma list of plain, plain_one, afd, afd_dbo (AFD with --enable-dbo "
                   "on the attention role); plain_one (--engines M): one plain engine of M x "
                   "batch. Default: plain,afd; with --engines M: plain,plain_one,afd")
    p.add_argument("--dbo-threshold", type=int, default=None,
                   help="afd_dbo: decode and prefill token threshold for micro-batches "
                   "(default: vLLM's)")
    p.add_argument("--enable-dbo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help="torch.compile (default eager)")
    p.add_argument("--compilation-config", help="JSON for LLM(compilation_config=...); not eager")
    p.add_argument("--connector-extra", help="JSON connector_extra_config for both AFD roles")
    p.add_argument("--ffn-schedule", default="join",
                   help="comma list of FFN schedules (connector_extra_config.ffn_schedule: "
                   "join, pingpong, auto); every AFD mode runs once per schedule, a run of "
                   "another than join named MODE_SCHEDULE (afd_pingpong, afd_auto), e.g. "
                   "join,pingpong compares them")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="fixed KV cache size instead of vLLM's profiling (two roles sharing "
                   "one GPU: the FFN rank's allocations during the attention's memory "
                   "profiling would count against it)")
    p.add_argument("--log-dir", help="keep the engines' logs (and traces) here instead of a "
                   "temporary directory")
    p.add_argument("--engines", type=int, default=1, metavar="M",
                   help="M engines at once: AFD modes run M attention ranks against one FFN "
                   "rank (MA1F), plain runs M replicas; same --batch per engine, decode "
                   "throughput added up")
    p.add_argument("--mps", action="store_true",
                   help="CUDA: run every engine under the CUDA MPS control daemon (started "
                   "and stopped here; benchmarks/mps.py), so that the processes sharing a "
                   "GPU run at once instead of time-slicing it")
    p.add_argument("--attention-gpu", default="0")
    p.add_argument("--ffn-gpu", default="1", help="GPU of the FFN rank ('0' to share one)")
    p.add_argument("--attention-cpus", help="CPU: cores of the AFD attention rank's process, "
                   "e.g. '0' or '0-3' (plain vLLM keeps all cores)")
    p.add_argument("--ffn-cpus", help="CPU: cores of the AFD FFN rank's process, e.g. '1'")
    p.add_argument("--breakdown", type=int, default=0, metavar="STEPS", dest="breakdown_steps",
                   help="AFD modes: after the timings, profile STEPS decode steps on both "
                   "roles and print the per-layer breakdown (benchmarks/breakdown.py)")
    p.add_argument("--trace-dir", help="--breakdown: keep the traces here (default: a "
                   "temporary directory)")
    roofline.add_arguments(p)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--_role", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--afd", help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    p.add_argument("--attention-rank", type=int, help=argparse.SUPPRESS)
    return p


def main() -> int:
    p = build_parser()
    a = p.parse_args()
    if a.output_len < 2:
        p.error("--output-len must be at least 2")
    if a.breakdown_steps < 0 or a.breakdown_steps == 1:
        p.error("--breakdown needs at least 2 steps")
    if a._role:
        pin_to_cpus(os.environ.get(CPUS_ENV))
    if a._role == "generate":
        return run_generate(a)
    if a._role == "ffn":
        return run_ffn(a)
    # SIGTERM (run_gpu.sh's `timeout`) unwinds the sweep: its engines (each in a session
    # of its own) are stopped and the MPS control daemon is told to quit.
    install_cleanup()
    batches, routings, modes = check_sweep(p, a)
    print_header(a, batches, routings, modes)
    results = run_sweep(a, common_args(a), batches, routings, modes)
    summary = summarize(results, batches, routings, modes)
    card = bounds = None
    model, why = roofline_model(a)
    if model is not None:
        card, why = roofline_card(a, results)
    if card is not None:
        add_bounds(a, summary, model, card)
        bounds = {"card": card.name, "hbm_tbs": card.hbm_tbs, "bf16_tflops": card.bf16_tflops,
                  "context": a.input_len + a.output_len / 2}
        print("\n" + roofline.describe(card, model, bounds["context"]), flush=True)
    else:
        print(f"\n{why}", flush=True)
    print_table(a, summary)
    print_breakdowns(a, results)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "mps": a.mps, "engines": a.engines,
                                            "rounds": a.rounds, "roofline": bounds,
                                            "summary": summary, "results": results},
                                           indent=1))
    failed = [r for r in results if "breakdown_error" in r]
    for r in failed:
        print(f"breakdown failed: batch {r['batch']} {r['mode']}: {r['breakdown_error']}",
              file=sys.stderr)
    return 1 if failed else 0


def check_sweep(p: argparse.ArgumentParser, a) -> tuple[list[int], list[str], list[str]]:
    """The sweep's batch sizes, routings and modes; ``p.error`` for what cannot run."""
    if bool(a.attention_cpus) != bool(a.ffn_cpus):
        p.error("--attention-cpus and --ffn-cpus go together")
    for spec in (a.attention_cpus, a.ffn_cpus):
        if spec:
            try:
                parse_cpus(spec)
            except ValueError as e:
                p.error(str(e))

    if a.engines < 1:
        p.error("--engines must be at least 1")
    if a.mps and a.device != "cuda":
        p.error("--mps needs --device cuda")
    if a.engines > 1 and a.breakdown_steps:
        p.error("--breakdown reads one attention rank's trace: use it with --engines 1")
    batches = [int(b) for b in a.batches.split(",")] if a.batches else [a.batch]
    if any(b < 1 for b in batches):
        p.error("batch sizes must be positive")
    if len(set(batches)) < len(batches):
        p.error(f"--batches {a.batches}: a batch size given twice (--rounds N measures each "
                "N times)")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    routings = ["model", "balanced"] if a.routing == "both" else [a.routing]
    if a.modes is None:
        a.modes = "plain,afd" if a.engines == 1 else "plain,plain_one,afd"
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = set(modes) - {"plain", "plain_one", "afd", "afd_dbo"}
    if bad:
        p.error(f"unknown mode(s) {sorted(bad)}")
    if "plain_one" in modes and a.engines < 2:
        p.error("--modes plain_one needs --engines 2 or more (with one engine it is plain)")
    if len(set(modes)) < len(modes):
        p.error(f"--modes {a.modes}: a mode given twice (--rounds N measures each N times)")
    try:
        schedules = parse_schedules(a.ffn_schedule)
        schedule_extra(a.connector_extra, "afd")
    except ValueError as e:
        p.error(str(e))
    modes = with_schedules(modes, schedules)
    roofline.check_arguments(p, a)
    return batches, routings, modes


def common_args(a) -> list[str]:
    """The arguments of every measuring process (the engine, its shapes and timings)."""
    common = ["--model", a.model, "--load-format", a.load_format, "--dtype", a.dtype,
              "--input-len", str(a.input_len),
              "--output-len", str(a.output_len), "--repeats", str(a.repeats)]
    if a.compile:
        common.append("--compile")
    if a.compilation_config:
        common += ["--compilation-config", a.compilation_config]
    if a.gpu_memory_utilization:
        common += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    if a.kv_cache_memory_bytes:
        common += ["--kv-cache-memory-bytes", str(a.kv_cache_memory_bytes)]
    if a.dbo_threshold is not None:
        common += ["--dbo-threshold", str(a.dbo_threshold)]
    return common


def print_header(a, batches: list[int], routings: list[str], modes: list[str]) -> None:
    """The machine and the sweep, and the notes on shared GPUs and dummy routing."""
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"device {a.device}; model {a.model} ({a.load_format}, {a.dtype}); batches {batches}, "
          f"input {a.input_len}, output {a.output_len}; connector {a.connector}; "
          f"compilation {a.compilation_config or ('compile' if a.compile else 'eager')}"
          + (f"; AFD cores attention {a.attention_cpus} / FFN {a.ffn_cpus}" if a.ffn_cpus
             else "")
          + (f"; {a.engines} engines at once (AFD {a.engines}A1F, plain x{a.engines}, "
             f"plain_one: one engine of {a.engines} x batch)" if a.engines > 1 else "")
          + (f"; GPU sharing: {'MPS' if a.mps else 'time-sliced (no MPS)'}"
             if a.device == "cuda" else ""), flush=True)
    for note in (shared_gpu_note(a.device, modes, a.attention_gpu, a.ffn_gpu, a.mps),
                 dummy_routing_note(a.load_format, routings)):
        if note:
            print(note, file=sys.stderr, flush=True)


def run_sweep(a, common: list[str], batches: list[int], routings: list[str],
              modes: list[str]) -> list[dict]:  # fmt: skip
    """Every (batch, routing, round, mode) measured, a line printed for each."""
    results = []
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
        workdir = contextlib.nullcontext(a.log_dir)
    else:
        workdir = tempfile.TemporaryDirectory(prefix="afd-decode-")
    with workdir as tmp, mps.daemon(a.mps) as mps_env:
        os.environ.update(mps_env)  # every engine this run starts inherits it
        for batch in batches:
            for routing in routings:
                for rnd, mode in rounds_of(modes, a.rounds):
                    t0 = time.perf_counter()
                    base = mode_args(a, common, mode, batch)
                    r = measure(a, base, mode, routing, Path(tmp), batch, rnd)
                    r.update(mode=mode, routing=routing, batch=batch, round=rnd,
                             wall_s=time.perf_counter() - t0)
                    results.append(r)
                    print(f"  batch {batch:4d} {mode:9s} routing={routing:8s} "
                          f"TPOT {r['tpot_s'] * 1e3:8.2f} ms (median step "
                          f"{r['itl_median_s'] * 1e3:.2f}, two lengths "
                          f"{r['tpot_diff_s'] * 1e3:.2f})  decode "
                          f"{decode_tok_s(r, batch):9.1f} tok/s  prefill "
                          f"{r['prefill_s']:.3f} s  ({r['wall_s']:.0f} s"
                          + (f", round {rnd + 1}/{a.rounds})" if a.rounds > 1 else ")"),
                          flush=True)
    return results


def mode_args(a, common: list[str], mode: str, batch: int) -> list[str]:
    """The measuring processes' arguments for one mode at ``batch`` per replica or
    attention rank: ``plain_one`` runs M x batch sequences in one engine, with M times the
    KV cache each replica gets (the replicas' memory together)."""
    args = [*common, "--batch", str(engine_batch(a, mode, batch))]
    if mode == "plain_one" and a.kv_cache_memory_bytes:
        i = args.index("--kv-cache-memory-bytes")
        args[i + 1] = str(a.kv_cache_memory_bytes * a.engines)
    return args


def print_table(a, summary: list[dict]) -> None:
    """Each mode's TPOT, decode throughput, ratios to plain vLLM (the replicas and, with
    --engines M, the one engine of M x b) and the step as a fraction of its roofline."""
    span = f", median of {a.rounds} rounds (range)" if a.rounds > 1 else ""
    many = a.engines > 1
    bounds = any(r.get("bound_s") for r in summary)
    print("\nbatch routing   mode        TPOT ms     tok/s  "
          + (f"vs x{a.engines}  vs 1x{a.engines}b" if many else "vs plain")
          + ("   bound ms  bound tok/s  of bound" if bounds else "")
          + f"   [{a.engines} engine(s) per mode" + (f", {'MPS' if a.mps else 'no MPS'}"
                                                   if a.device == "cuda" else "") + f"{span}]")
    for row in summary:
        line = (f"{row['batch']:5d} {row['routing']:9s} {row['mode']:9s} "
                f"{row['tpot_s'] * 1e3:9.2f} {row['decode_tok_s']:9.1f}  "
                f"{_ratio(row['vs_plain']):>6s}")
        if many:
            line += f"  {_ratio(row.get('vs_one')):>8s}"
        if bounds:
            line += (f"   {row['bound_s'] * 1e3:8.2f}  {row['bound_tok_s']:11.0f}  "
                     f"{row['of_bound']:8.1%}" if row.get("bound_s") else "   -")
        if a.rounds > 1:
            line += f"   ({row['tpot_min_s'] * 1e3:.2f}-{row['tpot_max_s'] * 1e3:.2f} ms)"
        print(line)


def _ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "-"


# ------------------------------------------------------------------ roofline
def roofline_model(a):
    """The roofline's model of ``--model``'s config in ``--dtype`` (benchmarks/roofline.py);
    (None, reason) where it cannot be read."""
    return roofline.model_for(a.model, a.dtype)


def roofline_card(a, results: list[dict]):
    """The roofline's card: ``--card``, else the one the engines ran on (their device
    name), with ``--hbm-tbs``/``--tflops`` over it (benchmarks/roofline.py)."""
    return roofline.card_for(a.card, a.hbm_tbs, a.tflops,
                             [r["device"] for r in results if r.get("device")])


def add_bounds(a, summary: list[dict], model, card) -> None:
    """Each summary row's roofline (vllm.afd.plan.step_bound): the bound of its step, the
    tokens/s that allows, and the measured step as a fraction of it (``of_bound``: the
    bound over the measured TPOT). Context: the mean over the timed decode, input +
    output / 2. Routing: balanced as run; the model's router as uniform (a trained
    router's batch is close to it; dummy weights may touch fewer experts)."""
    from vllm.afd import plan

    same_gpu = a.device != "cuda" or a.attention_gpu == a.ffn_gpu
    context = a.input_len + a.output_len / 2
    for row in summary:
        mode = roofline.bound_mode(*split_mode(row["mode"]))
        if mode is None:  # auto: a mix of joined and interleaved rounds, no one bound
            continue
        routing = roofline.routing_of(row["routing"])
        b = plan.step_bound(model, card, mode, a.engines, row["batch"], context, routing,
                            same_gpu)
        row.update(bound_s=b.step_s, bound_tok_s=b.tok_s, of_bound=b.step_s / row["tpot_s"],
                   bound_limit=b.limit, bound_bytes=b.bytes)


def print_breakdowns(a, results: list[dict]) -> None:
    """The per-layer breakdown of the runs that profiled one (--breakdown)."""
    with_bd = [r for r in results if "breakdown" in r]
    if with_bd:
        print("\nper-layer breakdown (us per step; benchmarks/breakdown.py): attention, FFN "
              "compute, transfer, bound = max(attention, FFN) + transfer, profiled step, gap")
        for r in with_bd:
            c = r["breakdown"]["combined_us"]
            layers = r["breakdown"]["attention"]["layers_per_step"]
            rnd = f" round {r['round'] + 1}" if a.rounds > 1 else ""
            print(f"{r['batch']:5d} {r['routing']:9s} {r['mode']:8s}{rnd} attention "
                  f"{c['attention']:9.1f}  FFN {c['ffn compute']:9.1f}  transfer "
                  f"{c['transfer']:8.1f}  bound {c['bound']:9.1f}  step {c['step']:9.1f}  "
                  f"gap {c['gap %']:5.1f}%  ({layers:g} exchanges/step)")


if __name__ == "__main__":
    sys.exit(main())
