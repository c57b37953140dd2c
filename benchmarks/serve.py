"""Serving benchmark through the OpenAI API: plain vLLM vs AFD 1A1F, with ``vllm bench serve``.

The reference serving configuration (docs/benchmarks.md) runs this way (64 requests of 64 prompt and 256
output tokens sent at once, at most 64 sequences and 64 batched tokens per step, FULL decode
graphs of size 64); on the GPU host, after ``benchmarks/make_shape.py --preset
deepseek-v2-lite --out CONFIG_DIR``::

    python3 benchmarks/serve.py --model CONFIG_DIR --load-format dummy --device cuda \\
        --modes plain,afd,afd_dbo,plain_x2 --num-prompts 64 --input-len 64 --output-len 256 \\
        --attention-gpu 0 --ffn-gpu 1 --connector cuda_ipc --serve-args "--dtype bfloat16 \\
        --max-num-seqs 64 --max-num-batched-tokens 64 --compilation-config \\
        '{\\"cudagraph_mode\\": \\"FULL_DECODE_ONLY\\", \\"cudagraph_capture_sizes\\": [64]}'"

On the CPU (tiny checkpoint, a functional check rather than a figure)::

    .venv/bin/python benchmarks/serve.py --model build/models/qwen3_moe --modes plain,afd

Modes: ``plain`` (one ``vllm serve``), ``afd`` (an FFN server and an attention server),
``afd_dbo`` (the same, the attention server with ``--enable-dbo``), ``plain_x2`` (two plain
servers, one per GPU, each sent ``--num-prompts`` requests at once, figures summed: what a
user with two GPUs would run instead of AFD 1A1F), ``plain_one`` (ONE plain server sent
plain_x2's total, 2 x ``--num-prompts`` requests at once, with its per-server sizes doubled:
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--kv-cache-memory-bytes`` and the
compilation config's CUDA graph sizes: what a user with one GPU runs instead of two
replicas). Every mode's servers are started, measured and stopped before the next mode's.

``--engines M`` (M >= 2) compares the three ways of serving M x ``--num-prompts``
concurrent requests on one device, as ``decode.py --engines M`` does for decode: ``plain``
is M plain servers (replicas), ``plain_one`` ONE plain server of M times the load and
sizes, ``afd`` (and ``afd_dbo``) M attention servers (ranks 0..M-1) of one FFN server
(MA1F); every server the clients talk to is sent ``--num-prompts`` requests at once (the
one server M times that), all at the same time, figures summed. On CUDA every server shares
the attention GPU under ``--mps``. ``--ffn-schedule join,pingpong,auto`` runs every AFD mode
once per FFN schedule (``afd_pingpong``...: docs/ping-pong.md).
``--batches B1,B2,...`` measures every mode at several batch sizes against the same
servers, started once: at each size B every server a client talks to is sent B requests at
once (B warm-ups first), plain_one M x B; the servers must admit the largest B
(``--max-num-seqs``). A server start (compilation, CUDA graphs, for AFD every rank's graphs
with the FFN rank's) takes minutes on a GPU host, a measurement seconds.
Figures per mode, from ``vllm bench serve``'s result: output tokens/s, requests/s, mean and
median TPOT and TTFT, the duration; the table gives each against plain, against
``plain_one`` where it ran, and against the roofline of a decode step at the mode's
concurrency (benchmarks/roofline.py: the bytes and FLOPs of the step over the card's
figures; serving also spends time on prefill, so the fraction is below decode's).

``--routing balanced`` starts every server (plain and both AFD roles) with
``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=afd_balanced``: each step spreads its tokens over all
the experts, as a trained model's router roughly does. With ``--load-format dummy`` the
checkpoint's router (``model``, the default) can route every token to the same experts
(DeepSeek-V2: docs/benchmarks.md, "Dummy weights and MoE routing"), so the MoE then reads a
fraction of the expert weights a real model reads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import mps  # noqa: E402  (benchmarks/mps.py)
import roofline  # noqa: E402  (benchmarks/roofline.py)

import serve_util as su  # noqa: E402

MODES = ("plain", "afd", "afd_dbo", "plain_x2", "plain_one")
# plain_one serves the requests of plain_x2's two replicas in one server.
ONE_OF = 2
# Per-server sizes that plain_one doubles.
SCALED_FLAGS = ("--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory-bytes")
# vllm bench serve's result keys reported here (summed over plain_x2's replicas where
# marked True, averaged otherwise).
FIGURES = {
    "completed": True,
    "total_output_tokens": True,
    "output_throughput": True,
    "request_throughput": True,
    "mean_tpot_ms": False,
    "median_tpot_ms": False,
    "mean_ttft_ms": False,
    "median_ttft_ms": False,
    "duration": False,
}


class BenchError(RuntimeError):
    pass


CAPTURE_LINE = re.compile(r"captured a CUDA graph for step (.+) in ([0-9.]+) ms")


def ffn_captures(log_text: str) -> list[dict]:
    """The CUDA graphs an FFN server's log says it captured (over its whole life: the
    attention server's graph warm-up, the clients' warm-ups and the measured requests),
    each with its step key and milliseconds: every attention rank served waits meanwhile."""
    return [{"step": m.group(1), "ms": float(m.group(2))}
            for m in CAPTURE_LINE.finditer(log_text)]


def load_factor(a, mode: str) -> int:
    """How many servers' load one server of ``mode`` takes: plain_one the M replicas'
    (``--engines``), or plain_x2's two; every other mode's server its own."""
    if su.split_mode(mode)[0] != "plain_one":
        return 1
    return a.engines if a.engines > 1 else ONE_OF


def client_count(a, mode: str) -> int:
    """The servers of a mode a client is sent requests to (they come first in the list
    servers_for returns): plain_x2's two, M replicas or attention servers, else one."""
    base = su.split_mode(mode)[0]
    if base == "plain_x2":
        return 2
    return 1 if base == "plain_one" else a.engines


def bench_command(a, url: str, result_dir: Path, name: str, factor: int = 1) -> list[str]:
    """argv of the ``vllm bench serve`` client against the server at ``url``; ``factor``
    times the requests (and the concurrency and warm-ups): plain_one's."""
    return [
        *su.vllm_cli(), "bench", "serve",
        "--backend", "vllm", "--base-url", url,
        "--model", str(a.model), "--tokenizer", str(a.model),
        "--dataset-name", "random",
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--random-range-ratio", "0",
        "--num-prompts", str(factor * a.num_prompts),
        "--max-concurrency", str(factor * (a.max_concurrency or a.num_prompts)),
        "--request-rate", "inf", "--ignore-eos", "--seed", "0",
        "--num-warmups", str(factor * a.warmups),
        "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json",
    ]  # fmt: skip


def server_args(a) -> list[str]:
    args = ["--load-format", a.load_format, "--seed", "0", "--no-enable-prefix-caching",
            "--max-model-len", str(a.input_len + a.output_len + 16)]
    return args + shlex.split(a.serve_args or "")


def server_flag(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag N`` or ``--flag=N``, the last one given) in server
    arguments, or None."""
    val = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            val = args[i + 1]
        elif arg.startswith(flag + "="):
            val = arg.split("=", 1)[1]
    return val


def scaled_args(args: list[str], factor: int) -> list[str]:
    """Server flags with every per-server size ``factor`` times as large (``SCALED_FLAGS``,
    as ``--flag N`` or ``--flag=N``; in a ``--compilation-config`` JSON the CUDA graph
    capture sizes and their maximum): one server taking the load of ``factor``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        flag, eq, val = arg.partition("=")
        if flag in (*SCALED_FLAGS, "--compilation-config", "-cc"):
            if not eq:
                if i + 1 >= len(args):
                    raise ValueError(f"{flag} without a value")
                val, i = args[i + 1], i + 1
            val = (_scaled_compilation(val, factor) if flag in ("--compilation-config", "-cc")
                   else str(int(val) * factor))
            out += [f"{flag}={val}"] if eq else [flag, val]
        else:
            out.append(arg)
        i += 1
    return out


def _scaled_compilation(text: str, factor: int) -> str:
    cfg = json.loads(text)
    if "cudagraph_capture_sizes" in cfg:
        sizes = sorted(set(cfg["cudagraph_capture_sizes"]))
        cfg["cudagraph_capture_sizes"] = sorted(set(sizes) | {s * factor for s in sizes})
    if cfg.get("max_cudagraph_capture_size"):
        cfg["max_cudagraph_capture_size"] *= factor
    return json.dumps(cfg)


def server_env(a, own: str, peer: str | None) -> dict[str, str]:
    """Environment of one server: the benchmark routing and its GPUs (CUDA)."""
    env = su.routing_env(a.routing)
    if a.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = su.cuda_visible_devices(own, peer, a.connector)
    return env


def start(a, name: str, work: Path, *, afd: dict | None = None, env: dict | None = None,
          extra: list[str] | None = None, factor: int = 1) -> su.Server:
    port = su.free_port()
    print(f"  starting {name} server (port {port}, log {work / f'{name}.log'})", flush=True)
    args = [*server_args(a), *(extra or [])]
    return su.Server.start(name, a.model, port, work / f"{name}.log", afd_config=afd,
                           python=sys.executable, env=env,
                           extra_args=scaled_args(args, factor) if factor > 1 else args,
                           cpu_args=a.device == "cpu")


def servers_for(a, mode: str, work: Path) -> list[su.Server]:
    """Start the servers of one mode (FFN first) and wait until all are healthy; the
    ones the client talks to come first in the returned list."""
    servers: list[su.Server] = []
    base = su.split_mode(mode)[0]
    try:
        plain_extra = shlex.split(a.plain_args or "")
        if base == "plain":
            for i in range(a.engines):
                name = "plain" if a.engines == 1 else f"plain_{i}"
                servers.append(start(a, name, work, env=server_env(a, a.attention_gpu, None),
                                     extra=plain_extra))
        elif base == "plain_one":
            servers.append(start(a, "plain_one", work, env=server_env(a, a.attention_gpu, None),
                                 extra=plain_extra, factor=load_factor(a, mode)))
        elif base == "plain_x2":
            for i, gpu in enumerate((a.attention_gpu, a.ffn_gpu)):
                servers.append(start(a, f"plain_x2_{i}", work, env=server_env(a, gpu, None),
                                     extra=plain_extra))
        else:
            cfg = dict(port=su.free_port(), connector=a.connector, timeout_s=a.afd_timeout,
                       num_attention_ranks=a.engines)
            if extra := su.schedule_extra(a.connector_extra, mode):
                cfg["connector_extra_config"] = extra
            ffn = start(a, f"{mode}_ffn", work, afd=su.afd_config("ffn", **cfg),
                        env=server_env(a, a.ffn_gpu, a.attention_gpu))
            servers.append(ffn)
            extra = shlex.split(a.attention_args or "")
            if base == "afd_dbo":
                extra.append("--enable-dbo")
            for i in range(a.engines):
                name = f"{mode}_attention" + ("" if a.engines == 1 else f"_{i}")
                attn = start(a, name, work, afd=su.afd_config("attention", rank=i, **cfg),
                             env=server_env(a, a.attention_gpu, a.ffn_gpu), extra=extra)
                servers.insert(i, attn)
        took = su.wait_all_healthy(servers, timeout=a.start_timeout)
        print("  healthy after " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()),
              flush=True)
        return servers
    except BaseException:
        su.stop_servers(servers)
        raise


def run_clients(a, mode: str, clients: list[su.Server], work: Path) -> list[dict]:
    """One ``vllm bench serve`` per client server, all at once; their results."""
    procs = []
    for srv in clients:
        log = open(work / f"{srv.name}_bench.log", "w")
        cmd = bench_command(a, srv.url, work, f"{srv.name}_result", load_factor(a, mode))
        procs.append((srv, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL), log))
    deadline = time.monotonic() + a.timeout
    results = []
    try:
        for srv, proc, _ in procs:
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"{mode}: vllm bench serve against {srv.name} gave no result "
                                 f"within {a.timeout:.0f} s; server log tail:\n"
                                 f"{srv.log_tail(30)}") from None
            if rc != 0:
                raise BenchError(f"{mode}: vllm bench serve against {srv.name} failed (rc="
                                 f"{rc}):\n{su.log_tail(work / f'{srv.name}_bench.log', 30)}"
                                 f"\n--- server ---\n{srv.log_tail(30)}")
            results.append(json.loads((work / f"{srv.name}_result.json").read_text()))
    finally:
        for _, proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return results


def combine(results: list[dict]) -> dict:
    out = {}
    for key, summed in FIGURES.items():
        vals = [float(r[key]) for r in results if r.get(key) is not None]
        if vals:
            out[key] = sum(vals) if summed else sum(vals) / len(vals)
    return out


def at_batch(a, batch: int) -> argparse.Namespace:
    """The arguments of one measurement at ``batch`` (``--batches``): B requests per server
    at once and, unless ``--warmups`` was given, B warm-ups."""
    return argparse.Namespace(**{**vars(a), "num_prompts": batch, "max_concurrency": None,
                                 "warmups": batch if a.batch_warmups is None
                                 else a.batch_warmups})


def measure(a, mode: str, work: Path, report) -> None:
    """Start a mode's servers once and measure them at each of ``a.batches`` (one
    measurement at ``--num-prompts`` without ``--batches``), calling ``report(at, fig)``
    after each (``at``: the arguments of that measurement, at_batch); an AFD figure lists
    the FFN server's graph captures since the one before (the first's include the
    servers' start)."""
    servers = servers_for(a, mode, work)
    n = client_count(a, mode)
    seen = 0
    try:
        for batch in a.batches or [None]:
            at = a if batch is None else at_batch(a, batch)
            out = work if batch is None else work / f"b{batch}"
            out.mkdir(parents=True, exist_ok=True)
            results = run_clients(at, mode, servers[:n], out)
            for srv in servers:
                srv.check_alive()
            fig = combine(results)
            if mode.startswith("afd"):
                text = servers[n].log_path.read_text(errors="replace")
                fig["ffn_graph_captures"] = ffn_captures(text[seen:])
                seen = len(text)
            want = at.num_prompts * len(results) * load_factor(a, mode)
            if int(fig.get("completed", 0)) != want:
                raise BenchError(f"{mode}: {int(fig.get('completed', 0))} of {want} requests "
                                 "completed" + (f" at batch {batch}" if batch else ""))
            report(at, fig)
    finally:
        su.stop_servers(servers)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint or config directory")
    p.add_argument("--load-format", default="auto", help="'dummy' for real shapes, no weights")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--modes", default="plain,afd", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per server (default 8)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight per server (default: all of them)")
    p.add_argument("--batches", metavar="B1,B2,...",
                   help="measure every mode at each batch size against the same servers, "
                   "started once: B requests per server at once (plain_one M x B), B "
                   "warm-ups unless --warmups; instead of --num-prompts and "
                   "--max-concurrency; the servers must admit the largest (--max-num-seqs)")
    p.add_argument("--warmups", type=int, default=None,
                   help="warm-up requests per server before the measured ones, sent at once "
                   "(default: as many as --num-prompts, so that the warm-up meets the run's "
                   "batch sizes: kernels compiled on first use, e.g. Triton's fused MoE per "
                   "batch size, are compiled before the measurement)")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--serve-args", help="more `vllm serve` flags for every server, one "
                   "string (e.g. \"--dtype bfloat16 --max-num-seqs 64\")")
    p.add_argument("--attention-args", help="more flags for the AFD attention server only "
                   "(e.g. \"--dbo-decode-token-threshold 8\")")
    p.add_argument("--plain-args", help="more flags for the plain servers only (plain, "
                   "plain_x2): with --attention-args, each side gets its own best flags, e.g. "
                   "plain with vLLM's defaults beside AFD with FULL_DECODE_ONLY graphs")
    p.add_argument("--routing", choices=["model", "balanced"], default="model",
                   help="MoE routing of every server: the checkpoint's router or afd_balanced")
    p.add_argument("--connector", default="gloo")
    p.add_argument("--connector-extra", help="JSON connector_extra_config for both AFD roles")
    p.add_argument("--ffn-schedule", default="join",
                   help="comma list of FFN schedules (connector_extra_config.ffn_schedule: "
                   "join, pingpong, auto); every AFD mode runs once per schedule, a run of "
                   "another than join named MODE_SCHEDULE (afd_pingpong)")
    p.add_argument("--engines", type=int, default=1, metavar="M",
                   help="M >= 2: plain runs M replicas, plain_one one server of M times the "
                   "load, afd M attention servers of one FFN server, each sent "
                   "--num-prompts requests (on CUDA all on the attention GPU, with --mps)")
    p.add_argument("--afd-timeout", type=float, default=120.0, help="AFD timeout_s")
    p.add_argument("--attention-gpu", default="0", help="GPU of plain / the attention server")
    p.add_argument("--ffn-gpu", default="1", help="GPU of the FFN server (plain_x2: the "
                   "second replica's)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=900.0, help="per bench client")
    p.add_argument("--log-dir", help="keep servers' and clients' logs here")
    p.add_argument("--mps", action="store_true",
                   help="CUDA: run every server under the CUDA MPS control daemon (started "
                   "and stopped here; benchmarks/mps.py): processes sharing a GPU run at once")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="start every mode's servers N times, the modes' order reversed every "
                   "other round; the table gives each mode's median run by output throughput "
                   "(one H200's engines differed by several percent from start to start)")
    roofline.add_arguments(p)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.mps and a.device != "cuda":
        p.error("--mps needs --device cuda")
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: unknown {bad} (choose from {', '.join(MODES)})")
    if len(set(modes)) < len(modes):
        p.error(f"--modes {a.modes}: a mode given twice (--rounds N measures each N times)")
    try:
        modes = su.with_schedules(modes, su.parse_schedules(a.ffn_schedule))
        su.schedule_extra(a.connector_extra, "afd")
    except ValueError as e:
        p.error(str(e))
    if a.engines < 1:
        p.error("--engines must be at least 1")
    if a.engines > 1 and "plain_x2" in modes:
        p.error("--engines M: plain runs the M replicas (plain_x2 is two replicas on two "
                "GPUs, a 1A1F comparison)")
    if a.engines > 1 and a.device == "cuda" and not a.mps:
        p.error("--engines M on CUDA needs --mps: M servers time-sliced on one GPU measure "
                "nothing useful")
    if "plain_x2" in modes and (a.device != "cuda" or (a.attention_gpu == a.ffn_gpu
                                                       and not a.mps)):
        p.error("--modes plain_x2 needs two GPUs (--device cuda, --attention-gpu and "
                "--ffn-gpu different) or --mps: two time-sliced replicas on one device "
                "measure nothing useful")
    a.batch_warmups = a.warmups
    if a.batches is not None:
        try:
            a.batches = sorted({int(b) for b in a.batches.split(",")})
        except ValueError:
            a.batches = []
        if not a.batches or a.batches[0] < 1:
            p.error(f"--batches {a.batches!r}: a comma list of positive integers")
        if a.num_prompts is not None or a.max_concurrency is not None:
            p.error("--batches sets the requests per server (B at once): drop "
                    "--num-prompts and --max-concurrency")
        a.num_prompts = a.batches[-1]
        seqs = server_flag(shlex.split(a.serve_args or ""), "--max-num-seqs")
        if seqs is not None and int(seqs) < a.batches[-1]:
            p.error(f"--batches {a.batches[-1]} with --max-num-seqs {seqs}: a server would "
                    f"run at most {seqs} of the {a.batches[-1]} requests at once")
    elif a.num_prompts is None:
        a.num_prompts = 8
    if a.num_prompts < 1 or a.input_len < 1 or a.output_len < 2:
        p.error("--num-prompts and --input-len must be at least 1, --output-len at least 2")
    if not Path(a.model).is_dir():
        p.error(f"--model {a.model}: not a directory")
    if a.warmups is None:
        a.warmups = a.num_prompts
    elif a.warmups < 0:
        p.error("--warmups must be at least 0")
    if "plain_one" in modes:
        try:
            scaled_args(shlex.split(a.serve_args or "") + shlex.split(a.plain_args or ""),
                        load_factor(a, "plain_one"))
        except (ValueError, json.JSONDecodeError) as e:
            p.error(f"--modes plain_one: cannot double the server sizes: {e}")
    roofline.check_arguments(p, a)
    a.modes = modes
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    su.install_cleanup()
    count = (f"batches {','.join(map(str, a.batches))}: B" if a.batches
             else str(a.num_prompts))
    print(f"model {a.model} ({a.load_format}), device {a.device}, {count} requests "
          f"of {a.input_len} + {a.output_len} tokens per server, engines {a.engines}, "
          f"connector {a.connector}, FFN schedule(s) {a.ffn_schedule}, "
          f"routing {a.routing}; GPU sharing: {'MPS' if a.mps else 'time-sliced (no MPS)'}; "
          f"serve args: {a.serve_args or '-'}; plain only: {a.plain_args or '-'}; AFD "
          f"attention only: {a.attention_args or '-'}", flush=True)
    for note in (su.shared_gpu_note(a.device, a.modes, a.attention_gpu, a.ffn_gpu, a.mps),
                 su.dummy_routing_note(a.load_format, [a.routing])):
        if note:
            print(note, file=sys.stderr, flush=True)
    model, card = roofline_setup(a)
    results = []
    with tempfile.TemporaryDirectory(prefix="afd-serve-bench-") as tmp, \
            mps.daemon(a.mps) as mps_env:
        os.environ.update(mps_env)  # every server this run starts inherits it
        work = Path(a.log_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for rnd, mode in su.rounds_of(a.modes, a.rounds):
            name = mode if a.rounds == 1 else f"{mode}-{rnd + 1}"
            print(f"{name}:", flush=True)
            report = Reporter(a, results, model, card, mode, rnd, name)
            try:
                measure(a, mode, work / name, report)
            except (BenchError, su.ServerDied) as e:
                print(f"{name} failed: {e}", file=sys.stderr, flush=True)
                print_table(a, results)
                return 1
    print_table(a, results)
    return 0


class Reporter:
    """Records and prints each figure of one run of a mode as it comes (``measure``'s
    ``report``): its batch, its seconds since the one before (the first's include the
    servers' start), its roofline; the JSON is rewritten each time, so a run cut short keeps
    the figures it had."""

    def __init__(self, a, results: list[dict], model, card, mode: str, rnd: int, name: str):
        self.a, self.results, self.model, self.card = a, results, model, card
        self.mode, self.rnd, self.name = mode, rnd, name
        self.t0 = time.perf_counter()

    def __call__(self, at: argparse.Namespace, fig: dict) -> None:
        a, batch, now = self.a, at.num_prompts, time.perf_counter()
        fig.update(mode=self.mode, round=self.rnd, batch=batch, wall_s=now - self.t0)
        self.t0 = now
        if self.card is not None and (
                b := serve_bound(at, self.mode, self.model, self.card)) is not None:
            fig.update(bound_tok_s=b.tok_s, bound_step_s=b.step_s,
                       of_bound=fig["output_throughput"] / b.tok_s)
        self.results.append(fig)
        write_json(a, self.results)
        label = f"{self.name} b{batch}" if a.batches else self.name
        print(f"  {label:9s} output {fig['output_throughput']:9.1f} tok/s  "
              f"TPOT mean {fig.get('mean_tpot_ms', float('nan')):7.2f} ms  "
              f"TTFT mean {fig.get('mean_ttft_ms', float('nan')):8.1f} ms  "
              f"({fig['wall_s']:.0f} s)", flush=True)
        if "ffn_graph_captures" in fig:
            caps = fig["ffn_graph_captures"]
            print(f"  {label:9s} FFN graphs captured "
                  + ("over the FFN server's life" if not a.batches
                     else "since the last figure (the first: since the start)")
                  + f": {len(caps)}, {sum(c['ms'] for c in caps):.0f} ms in all"
                  + "".join(f"; {c['step']} {c['ms']:.1f} ms" for c in caps), flush=True)


def median_runs(results: list[dict], modes: list[str]) -> dict[str, dict]:
    """Each mode's median run by output throughput (su.median_run); modes without a run
    (a run cut short) left out."""
    return {m: su.median_run(runs, lambda r: r["output_throughput"])
            for m in modes if (runs := [r for r in results if r["mode"] == m])}


def print_table(a, results: list[dict]) -> None:
    """A table per batch size (``--batches``; one without)."""
    for batch in a.batches or [None]:
        runs = [r for r in results if batch is None or r.get("batch") == batch]
        if runs:
            if batch is not None:
                print(f"\nbatch {batch} a server" + (
                    f" ({a.engines * batch} requests at once in all)" if a.engines > 1
                    else ""), end="")
            print_batch_table(a, runs)


def print_batch_table(a, results: list[dict]) -> None:
    """Each mode's median run: output tok/s against plain and, where it ran, against the
    one server of plain_x2's load (``plain_one``), TPOT, TTFT, and the decode roofline at
    the mode's concurrency with the output rate as a fraction of it."""
    median = median_runs(results, a.modes)
    base, one = median.get("plain"), median.get("plain_one")
    bounds = any(r.get("bound_tok_s") for r in median.values())
    span = f"   [median of {a.rounds} rounds]" if a.rounds > 1 else ""
    w = max(10, *(len(m) for m in median))  # afd_dbo_pingpong
    print("\n" + "mode".ljust(w) + " output tok/s   vs plain" + ("  vs plain_one" if one else "")
          + "   mean TPOT ms   mean TTFT ms"
          + ("   decode bound tok/s  of bound" if bounds else "") + span)
    for mode, r in median.items():
        tput = r["output_throughput"]
        ratio = f"{tput / base['output_throughput']:7.2f}x" if base else "-"
        runs = sorted(x["output_throughput"] for x in results if x["mode"] == mode)
        spread = f"   ({runs[0]:.1f}-{runs[-1]:.1f} tok/s)" if len(runs) > 1 else ""
        vs_one = (f"  {tput / one['output_throughput']:11.2f}x" if one else "")
        bound = (f"   {r['bound_tok_s']:18.0f}  {tput / r['bound_tok_s']:8.1%}"
                 if r.get("bound_tok_s") else ("   -" if bounds else ""))
        print(f"{mode:{w}s} {tput:12.1f}   {ratio:>8s}{vs_one}   "
              f"{r.get('mean_tpot_ms', float('nan')):12.2f}   "
              f"{r.get('mean_ttft_ms', float('nan')):12.1f}{bound}{spread}")


def serve_bound(a, mode: str, model, card):
    """The roofline of one decode step of a mode with every request running (concurrency
    ``--max-concurrency`` or ``--num-prompts`` per client): plain one engine (``--engines``
    replicas on one GPU); plain_x2 two replicas (their bytes add up on one GPU under MPS,
    else each GPU bounds its own); plain_one one engine of the replicas' load; AFD its
    roles, M attention ranks with ``--engines`` (one GPU or two), by the FFN schedule
    (roofline.bound_mode; None for auto, which has no one bound)."""
    from dataclasses import replace

    from vllm.afd import plan

    n = min(a.num_prompts, a.max_concurrency or a.num_prompts)
    ctx = a.input_len + a.output_len / 2
    routing = roofline.routing_of(a.routing)
    one_gpu = a.device != "cuda" or a.attention_gpu == a.ffn_gpu
    base, schedule = su.split_mode(mode)
    if base == "plain":
        return plan.step_bound(model, card, "plain", a.engines, n, ctx, routing)
    if base == "plain_one":
        return plan.step_bound(model, card, "plain_one", load_factor(a, mode), n, ctx, routing)
    if base == "plain_x2":
        if one_gpu:
            return plan.step_bound(model, card, "plain", 2, n, ctx, routing)
        b = plan.step_bound(model, card, "plain", 1, n, ctx, routing)
        return replace(b, tokens=2 * n)  # each GPU its replica's step
    kind = roofline.bound_mode(base, schedule)
    if kind is None:
        return None
    return plan.step_bound(model, card, kind, a.engines, n, ctx, routing, same_gpu=one_gpu)


def roofline_setup(a):
    """The roofline's model (the served config in --dtype of --serve-args) and card (by
    --card, or the attention GPU's name); (None, None) with the reason printed."""
    serve = shlex.split(a.serve_args or "")
    model, why = roofline.model_for(str(a.model), server_flag(serve, "--dtype"))
    card = None
    if model is not None:
        device = roofline.gpu_name(a.attention_gpu) if a.device == "cuda" else "cpu"
        card, why = roofline.card_for(a.card, a.hbm_tbs, a.tflops, [device] if device else [])
    if card is None:
        print(why, file=sys.stderr, flush=True)
        return None, None
    print(roofline.describe(card, model, a.input_len + a.output_len / 2), flush=True)
    return model, card


def write_json(a, results: list[dict]) -> None:
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "mps": a.mps,
                                            "results": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
