"""Start, probe, query and stop `vllm serve` processes (stdlib only).

Used by ``scripts/demo.py`` and by the CPU end-to-end tests; importable with
no dependency beyond the standard library::

    import serve_util as su

    su.install_cleanup()                       # SIGTERM/SIGHUP/atexit stop every server
    api, afd = su.free_ports(2)
    srv = su.Server.start(
        "ffn", model, api, log_dir / "ffn.log",
        afd_config=su.afd_config("ffn", afd), python=sys.executable,
    )
    srv.wait_healthy(timeout=300)
    status, body = su.completion(srv.url, "Hello", max_tokens=8)
    srv.stop()

Every server runs in its own session (``start_new_session=True``) so that
:func:`stop_process_group` reaches the API server and its engine-core
children, and every started server is kept in a registry until stopped so
that :func:`stop_all` (run by :func:`install_cleanup` at exit and on
SIGTERM/SIGHUP; Ctrl-C raises KeyboardInterrupt, so ``finally`` runs) leaves
no process behind on any exit path.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Flags for every server on the small CPU machine (no prefix caching: both sides of a
# comparison must compute every token).
CPU_SERVE_ARGS = [
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
    "--no-enable-prefix-caching",
    "--seed", "0",
]  # fmt: skip

# Environment for every vLLM engine these tools and tests start: a small KV cache on the CPU
# (1 GiB; ignored on CUDA), no FlashInfer sampler, no tokenizer thread pool. See engine_env.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
CPU_SERVE_ENV = ENGINE_ENV  # the name benchmarks and older callers know


# ---------------------------------------------------------------------------- ports
# Ports handed out for servers to listen on lie in a window below the kernel's ephemeral
# range: a port the kernel can pick by itself (an outgoing connection's source port, any
# program's bind(0), such as vLLM's internal ports or torch.distributed's store) may be
# taken between the moment it is handed out and the moment the server binds it: the
# server then fails with EADDRINUSE, or a client (the AFD attention rank retrying while
# its FFN rank starts) connects to itself or to that other listener. The window starts
# above the VLLM_PORT bases of internal_port_base (20000-29900; vLLM scans a few ports
# upward from its base).
LISTEN_WINDOW_START = 30100
# Two processes that hand out ports at once (`make test` runs tests/unit beside tests/cpu)
# each take a part of the window of their own: "LO-HI" (LO included, HI not). Neither then
# hands out a port the other has handed out and its server has not bound yet.
PORT_WINDOW_ENV = "AFD_PORT_WINDOW"
_HANDED_OUT: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (the Linux default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable_now(port: int, host: str) -> bool:
    # Without SO_REUSEADDR: a port with a connection in TIME_WAIT is skipped too.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listen_window() -> tuple[int, int]:
    """The ports free_ports hands out, ``[lo, hi)``: from LISTEN_WINDOW_START up to the
    kernel's ephemeral range, narrowed to the part ``$AFD_PORT_WINDOW`` ("LO-HI") names."""
    lo, hi = LISTEN_WINDOW_START, ephemeral_port_range()[0]
    spec = os.environ.get(PORT_WINDOW_ENV, "").strip()
    if spec:
        try:
            part_lo, part_hi = (int(v) for v in spec.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_WINDOW_ENV}={spec!r}: expected LO-HI, e.g. 30100-31500") from None
        lo, hi = max(lo, part_lo), min(hi, part_hi)
    return lo, hi


def free_ports(n: int = 1, host: str = "127.0.0.1", *, consecutive: bool = False) -> list[int]:
    """``n`` distinct TCP ports, free now, below the ephemeral range, none handed out
    before by this process (two servers started one after the other never get the same
    port, even while the first has not bound its port yet). With ``consecutive``, ``n``
    consecutive ports (an M:N FFN deployment listens on ``port + rank``). Where the
    ephemeral range leaves no room below it, the kernel's ``bind(0)`` picks them."""
    if n < 1:
        raise ValueError(f"free_ports: n must be >= 1, got {n}")
    lo, hi = listen_window()
    if hi - lo < 8 * n:
        return _kernel_ports(n, host, consecutive)
    if len(_HANDED_OUT) > (hi - lo) // 2:
        _HANDED_OUT.clear()  # a long-lived process: the servers of the oldest ports are gone
    rng = random.SystemRandom()
    for _ in range(500):
        if consecutive:
            base = rng.randrange(lo, hi - n + 1)
            ports = list(range(base, base + n))
        else:
            ports = rng.sample(range(lo, hi), n)
        if any(p in _HANDED_OUT for p in ports):
            continue
        if all(_bindable_now(p, host) for p in ports):
            _HANDED_OUT.update(ports)
            return ports
    raise RuntimeError(f"no {n} free port(s) on {host} in {lo}-{hi - 1}")


def _kernel_ports(n: int, host: str, consecutive: bool) -> list[int]:
    for _ in range(100):
        socks: list[socket.socket] = []
        try:
            for _ in range(1 if consecutive else n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, 0))
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        if consecutive:
            ports = list(range(ports[0], ports[0] + n))
            if ports[-1] > 65535 or not all(_bindable_now(p, host) for p in ports[1:]):
                continue
        return ports
    raise RuntimeError(f"no {n} free port(s) on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


# ---------------------------------------------------------------------------- commands
def afd_config(role: str, port: int, *, timeout_s: float = 120.0, host: str = "127.0.0.1",
               connector: str = "gloo", num_attention_ranks: int = 1, num_ffn_ranks: int = 1,
               **extra: Any) -> dict[str, Any]:
    """The ``--afd-config`` object of one side of an AFD deployment."""
    return {
        "role": role,
        "connector": connector,
        "host": host,
        "port": port,
        "num_attention_ranks": num_attention_ranks,
        "num_ffn_ranks": num_ffn_ranks,
        "timeout_s": timeout_s,
        **extra,
    }


def cuda_visible_devices(own: str, peer: str | None = None, connector: str = "") -> str:
    """CUDA_VISIBLE_DEVICES of a process on GPU ``own``: that GPU as device 0, and for an
    AFD role with the cuda_ipc connector also its peer's GPU (each side maps the other's
    memory). ``peer`` None: a plain engine."""
    if peer is not None and peer != own and connector in ("cuda_ipc", "ipc"):
        return f"{own},{peer}"
    return own


def shared_gpu_note(device: str, modes: list[str], attention_gpu: str, ffn_gpu: str,
                    mps: bool = False) -> str | None:
    """The note for AFD modes whose two roles share one GPU, or None; it says which of the
    two ways the GPU is shared. Without MPS two processes on one GPU time-slice it (one
    context runs at a time) and a role waiting for its peer holds its slice: measured on one
    H200 (2026-12-02), 2.2 ms per hand-over, AFD at 0.04x plain - a functional check, not a
    figure of AFD. Under CUDA MPS (``--mps``) both roles' kernels run at once and share the
    GPU's SMs and memory bandwidth."""
    if device != "cuda" or attention_gpu != ffn_gpu or not any(m.startswith("afd") for m in modes):
        return None
    if mps:
        return (f"note: both AFD roles on GPU {attention_gpu} under CUDA MPS: their kernels run "
                "at once and share the GPU's SMs and memory bandwidth, so the figures show "
                "AFD's overheads against plain vLLM on the same GPU, not a two-GPU deployment")
    return (f"note: both AFD roles on GPU {attention_gpu} without MPS: the two processes "
            "time-slice it and every layer's hand-over waits for a time slice, so the AFD "
            "figures measure the sharing, not AFD (docs/benchmarks.md, \"One H200, both roles "
            "on GPU 0\"); use --mps, or give the FFN rank its own GPU with --ffn-gpu")


ROUTING_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"


def routing_env(routing: str) -> dict[str, str]:
    """The environment of an engine for a benchmark's MoE routing: ``balanced`` the project's
    ``afd_balanced`` strategy (vllm/afd/routing.py), ``model`` the checkpoint's router (an
    empty strategy, which also overrides one this process inherited)."""
    if routing not in ("model", "balanced"):
        raise ValueError(f"unknown routing {routing!r}: 'model' or 'balanced'")
    return {ROUTING_ENV: "afd_balanced" if routing == "balanced" else ""}


def dummy_routing_note(load_format: str, routings: list[str]) -> str | None:
    """The warning for dummy weights with the checkpoint's MoE router, or None. vLLM's dummy
    weights make DeepSeek-V2's router logits about 1e-5; its bf16 softmax then gives every
    expert the same score and the whole batch takes the same top-k experts (measured on an
    H200 on 2026-12-03: 6 of 64), so the MoE reads a tenth of a trained model's weights."""
    if load_format != "dummy" or "model" not in routings:
        return None
    return ("note: dummy weights with the model's router: a MoE model may route every token "
            "to the same experts (DeepSeek-V2: 6 of 64), so its MoE reads a fraction of the "
            "weights a trained model reads (docs/benchmarks.md, \"Dummy weights and MoE "
            "routing\"); --routing balanced spreads the tokens over all experts")


def vllm_python(python: str | None = None) -> str:
    """The interpreter that runs ``vllm``: ``python`` or this one."""
    return python or sys.executable


# `vllm` CLI for an interpreter whose vLLM is installed as the upstream `vllm-cpu`
# distribution: vllm.entrypoints.cli.main reads importlib.metadata.version("vllm") and fails
# there (vllm.platforms already falls back to "vllm-cpu"); map the name, then run the CLI.
_CLI_SHIM = (
    "import importlib.metadata as m, sys\n"
    "_v = m.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return _v(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _v('vllm-cpu') + '+cpu'\n"
    "m.version = version\n"
    "sys.argv[0] = 'vllm'\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.exit(main())\n"
)
_CLI_PREFIX: dict[str, list[str]] = {}


def vllm_cli(python: str | None = None) -> list[str]:
    """argv prefix that runs the ``vllm`` CLI with ``python``: ``PY -m
    vllm.entrypoints.cli.main`` when the interpreter has a ``vllm`` distribution, else
    ``PY -c SHIM`` (see _CLI_SHIM). Probed once per interpreter (no vLLM import)."""
    py = vllm_python(python)
    if py not in _CLI_PREFIX:
        probe = subprocess.run(
            [py, "-c", "import importlib.metadata as m; m.version('vllm')"],
            capture_output=True, timeout=60,
        )
        _CLI_PREFIX[py] = ([py, "-m", "vllm.entrypoints.cli.main"] if probe.returncode == 0
                           else [py, "-c", _CLI_SHIM])
    return list(_CLI_PREFIX[py])


def serve_command(model: str | os.PathLike, port: int, *, python: str | None = None,
                  afd: dict[str, Any] | None = None, host: str = "127.0.0.1",
                  extra_args: list[str] | None = None, cpu_args: bool = True) -> list[str]:
    """argv of ``vllm serve MODEL`` run by ``python`` (see :func:`vllm_cli`)."""
    cmd = [*vllm_cli(python), "serve", str(model), "--host", host, "--port", str(port)]
    if cpu_args:
        cmd += CPU_SERVE_ARGS
    if afd is not None:
        cmd += ["--afd-config", json.dumps(afd)]
    cmd += list(extra_args or [])
    return cmd


_PORT_BASES: list[int] = []  # the bases handed out last, oldest first


def internal_port_base() -> int:
    """A ``VLLM_PORT`` for one server: where vLLM scans upward for its internal ports
    (torch.distributed, ZMQ). Without it vLLM takes ephemeral ports it checked a moment
    earlier, and a concurrent client connection can take the same port in between
    (EADDRINUSE at ``init_process_group``). Bases lie below the ephemeral range, 100
    apart; a base is not handed out again while it is among the last 50 handed out, so
    servers started close together never share one (vLLM checks a port is free before
    it binds it, but a multi-process server binds its store seconds after that check)."""
    bases = range(20000, 30000, 100)
    base = random.SystemRandom().choice([b for b in bases if b not in _PORT_BASES])
    _PORT_BASES.append(base)
    del _PORT_BASES[:-50]
    return base


def mla_disabled(model: str | os.PathLike) -> bool:
    """True for a DeepSeek checkpoint (by its directory name): vLLM's CPU backend has no MLA
    attention, so such a model runs there with VLLM_MLA_DISABLE=1."""
    return "deepseek" in Path(model).name


def engine_env(cpu_model: str | os.PathLike | None = None, *, in_process: bool = False,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one vLLM engine process (a ``vllm serve`` server, or an offline
    engine of the tests' ``afd_proc.py``): os.environ, ENGINE_ENV, then

    * ``cpu_model``: the checkpoint of an engine on the CPU; a DeepSeek one gets
      VLLM_MLA_DISABLE=1 (:func:`mla_disabled`). None for a GPU engine, or where the caller
      sets it;
    * ``in_process``: VLLM_ENABLE_V1_MULTIPROCESSING=0, the engine core in the process that
      creates the engine (one process per engine: faster start, and the FFN serve loop of
      ``afd_proc.py ffn`` is in the process that watches it);
    * ``extra`` (wins over everything above);
    * VLLM_PORT: a base of its own (:func:`internal_port_base`) unless ``extra`` gives one,
      so that engines started together never share their internal ports.
    """
    env = {**os.environ, **ENGINE_ENV}
    if cpu_model is not None and mla_disabled(cpu_model):
        env["VLLM_MLA_DISABLE"] = "1"
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra or {})
    if "VLLM_PORT" not in (extra or {}):
        env["VLLM_PORT"] = str(internal_port_base())
    return env


# ---------------------------------------------------------------------------- processes
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


def start_process(cmd: list[str], log_path: str | os.PathLike,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new session with stdout+stderr appended to ``log_path``; the
    process is registered for :func:`stop_all` until :func:`stop_process_group` ends it."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        shown = ["<vllm-cli-shim>" if "\n" in a else a for a in cmd]
        log.write(("$ " + " ".join(shown) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, from /proc (Linux)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _wait_group_gone(pgid: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if not group_members(pgid):
            return True
        time.sleep(0.1)
    return not group_members(pgid)


def stop_process_group(proc: subprocess.Popen, grace: float = 15.0,
                       sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` to the process group of ``proc`` (its session: start_process puts the
    process at the head of a new one), wait up to ``grace`` seconds for the whole group to
    exit, then SIGKILL what is left. Returns the exit code of ``proc`` (None if unknown)."""
    pgid = proc.pid  # start_new_session: pgid == pid, even after the leader exits
    try:
        if group_members(pgid) or proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            if sig != signal.SIGKILL:
                deadline = time.monotonic() + grace
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                if not _wait_group_gone(pgid, deadline):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            _wait_group_gone(pgid, time.monotonic() + 10)
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    return proc.poll()


def stop_processes(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    """Stop several process groups at once: SIGTERM to all, then one shared grace period
    before SIGKILL (so N servers take ``grace`` seconds at most, not N times that)."""
    procs = [p for p in procs if p is not None]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        stop_process_group(proc, grace=max(0.0, deadline - time.monotonic()))


def stop_all(grace: float = 10.0) -> None:
    """Stop every process started by :func:`start_process` and not yet stopped."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    stop_processes(procs, grace)


def stop_servers(servers: list[Server | None], grace: float = 15.0) -> None:
    """Stop several servers at once (None entries are skipped)."""
    stop_processes([s.proc for s in servers if s is not None], grace)


_CLEANUP_INSTALLED = False


def install_cleanup(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Stop all servers at interpreter exit, and turn ``signals`` into SystemExit(128+sig)
    so that ``finally`` blocks run (main thread only). Ctrl-C already raises
    KeyboardInterrupt. Idempotent."""
    global _CLEANUP_INSTALLED
    if _CLEANUP_INSTALLED:
        return
    _CLEANUP_INSTALLED = True
    atexit.register(stop_all)

    def handler(signum, frame):
        # Ignore repeats while cleaning up; the first one unwinds the main thread.
        for s in signals:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        for s in signals:
            signal.signal(s, handler)


def log_tail(log_path: str | os.PathLike, lines: int = 60) -> str:
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {log_path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def _traceback_blocks(lines: list[str]) -> list[list[str]]:
    """Each Python traceback of a log's lines, up to its error line."""
    def block(i: int) -> list[str]:
        out = [lines[i]]
        for ln in lines[i + 1:]:
            out.append(ln)
            body = ln.split("] ", 1)[-1] if "ERROR" in ln else ln.split(") ", 1)[-1]
            if body and not body.startswith((" ", "\t", "Traceback")) and (
                "Error" in body or "Exception" in body or "Interrupt" in body
            ):
                break
        return out

    return [block(i) for i, ln in enumerate(lines)
            if "Traceback (most recent call last)" in ln]


def _format_tracebacks(blocks: list[list[str]], max_lines: int) -> str:
    first = blocks[0]
    out = first[:max_lines] + (["    ..."] + first[-3:] if len(first) > max_lines else [])
    finals = []
    for b in blocks[1:]:
        if b[-1] not in finals and b[-1] != first[-1]:
            finals.append(b[-1])
    if finals:
        out += ["(later tracebacks end with:)"] + finals
    return "\n".join(out)


def _log_lines(log_path: str | os.PathLike) -> list[str] | None:
    try:
        return Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return None


def find_traceback(log_path: str | os.PathLike, max_lines: int = 60) -> str | None:
    """The first Python traceback of a log (usually the root cause; vLLM's wrappers re-raise
    it later as "Engine core initialization failed") plus the final exception line of every
    later one; None when the log has no traceback."""
    blocks = _traceback_blocks(_log_lines(log_path) or [])
    return _format_tracebacks(blocks, max_lines) if blocks else None


def failure_excerpt(log_path: str | os.PathLike, lines: int = 40) -> str:
    """For a test's failure report: the log's first traceback (the root cause: a
    worker's error sits far above the executor's re-raise), its last ``lines`` lines,
    and last the root cause's own line (what a truncated report still shows)."""
    all_lines = _log_lines(log_path)
    if all_lines is None:
        return log_tail(log_path, lines)  # says why it cannot be read
    last = "\n".join(all_lines[-lines:])
    blocks = _traceback_blocks(all_lines)
    if not blocks:
        return last
    return (f"{_format_tracebacks(blocks, 60)}\n--- last {lines} lines ---\n{last}\n"
            f"--- root cause: {blocks[0][-1].strip()}")


# ---------------------------------------------------------------------------- HTTP
def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; raises OSError (URLError, ConnectionError) when the
    connection fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def post_json(url: str, payload: dict[str, Any], timeout: float = 300.0) -> tuple[int, Any]:
    """(status, parsed JSON body or text) of a JSON POST; HTTP errors are returned, not
    raised; a failed connection or a timeout raises OSError."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def completion(base_url: str, prompt: str, *, timeout: float = 300.0,
               **params: Any) -> tuple[int, Any]:
    """POST /v1/completions (the model name is optional with one served model)."""
    return post_json(f"{base_url}/v1/completions", {"prompt": prompt, **params}, timeout)


def stream_completion(base_url: str, prompt: str, *, timeout: float = 300.0,
                      on_chunk: Any = None, **params: Any) -> dict[str, Any]:
    """POST /v1/completions with ``stream: true`` and read it to the end. Never raises for
    a server-side failure; returns ``{"status", "chunks", "text", "finish_reason", "error",
    "done"}``: ``error`` is an error chunk's message, an HTTP error or the exception that
    ended the stream (a reset connection, a timeout); ``done`` says "[DONE]" arrived.
    ``on_chunk(chunk)`` is called for every data chunk (e.g. to learn that tokens flow)."""
    out: dict[str, Any] = {"status": None, "chunks": 0, "text": "", "finish_reason": None,
                           "error": None, "done": False}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps({"prompt": prompt, **params, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out["status"] = r.status
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if "error" in chunk:
                    out["error"] = error_message(chunk)
                    continue
                out["chunks"] += 1
                for choice in chunk.get("choices") or []:
                    out["text"] += choice.get("text") or ""
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                if on_chunk is not None:
                    on_chunk(chunk)
    except urllib.error.HTTPError as e:
        out["status"] = e.code
        out["error"] = error_message(_json_or_text(e.read()))
    except Exception as e:  # noqa: BLE001 - any way the stream can end is a result here
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _json_or_text(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def error_message(body: Any) -> str:
    """The message of an OpenAI-style error body (or the body as text)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)


# ---------------------------------------------------------------------------- server
class ServerDied(RuntimeError):
    """A server exited, or did not become healthy in time; the message has its log tail."""


@dataclass
class Server:
    """One ``vllm serve`` process: its name, port, log and Popen."""

    name: str
    port: int
    log_path: Path
    proc: subprocess.Popen
    host: str = "127.0.0.1"
    started_at: float = field(default_factory=time.monotonic)
    healthy_after_s: float | None = None

    @classmethod
    def start(cls, name: str, model: str | os.PathLike, port: int,
              log_path: str | os.PathLike, *, afd_config: dict[str, Any] | None = None,
              python: str | None = None, env: dict[str, str] | None = None,
              extra_args: list[str] | None = None, host: str = "127.0.0.1",
              cpu_args: bool = True) -> Server:
        """Start ``vllm serve`` with the CPU flags (unless ``cpu_args`` is false) in the
        environment of :func:`engine_env` plus ``env``."""
        cmd = serve_command(model, port, python=python, afd=afd_config, host=host,
                            extra_args=extra_args, cpu_args=cpu_args)
        t0 = time.monotonic()
        proc = start_process(cmd, log_path, engine_env(extra=env))
        return cls(name=name, port=port, log_path=Path(log_path), proc=proc, host=host,
                   started_at=t0)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def healthy(self) -> bool:
        try:
            return http_get(f"{self.url}/health", timeout=2.0)[0] == 200
        except OSError:
            return False

    def check_alive(self) -> None:
        if not self.alive():
            raise ServerDied(
                f"{self.name} server exited with code {self.proc.returncode}; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )

    def wait_healthy(self, timeout: float = 300.0, deadline: float | None = None,
                     poll: float = 0.5) -> float:
        """Wait for GET /health == 200 while checking that the process lives; returns the
        seconds since start. Raises ServerDied (with the log tail) on exit or timeout."""
        if deadline is None:
            deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if self.healthy():
                self.healthy_after_s = time.monotonic() - self.started_at
                return self.healthy_after_s
            if time.monotonic() > deadline:
                raise ServerDied(
                    f"{self.name} server not healthy after "
                    f"{time.monotonic() - self.started_at:.0f} s; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(poll)

    def completion(self, prompt: str, *, timeout: float = 300.0, **params: Any):
        return completion(self.url, prompt, timeout=timeout, **params)

    def stop(self, grace: float = 15.0) -> int | None:
        return stop_process_group(self.proc, grace=grace)

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (a crash, as far as peers can tell)."""
        return stop_process_group(self.proc, sig=signal.SIGKILL)

    def gone(self) -> bool:
        """True when no process of this server's group is left."""
        return self.proc.poll() is not None and not group_members(self.pgid)


def wait_all_healthy(servers: list[Server], timeout: float = 300.0) -> dict[str, float]:
    """Wait for several servers under one deadline, checking all of them each round (so
    a peer that died is noticed while another one still waits); name -> seconds."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for srv in list(pending):
            srv.check_alive()
            if srv.healthy():
                srv.healthy_after_s = time.monotonic() - srv.started_at
                pending.remove(srv)
        if pending and time.monotonic() > deadline:
            srv = pending[0]
            raise ServerDied(
                f"{srv.name} server not healthy after {timeout:.0f} s; log {srv.log_path}:\n"
                f"{srv.log_tail()}"
            )
        if pending:
            time.sleep(0.5)
    return {s.name: s.healthy_after_s or 0.0 for s in servers}


# ---------------------------------------------------------------------------- results
def parse_choice(body: dict[str, Any]) -> dict[str, Any]:
    """text, tokens (strings; "token_id:N" with return_tokens_as_token_ids) and per-position
    top logprobs ({token: logprob}) of the first choice of a completion response."""
    choice = body["choices"][0]
    lp = choice.get("logprobs") or {}
    return {
        "text": choice.get("text", ""),
        "tokens": list(lp.get("tokens") or []),
        "token_logprobs": list(lp.get("token_logprobs") or []),
        "top_logprobs": [dict(d or {}) for d in (lp.get("top_logprobs") or [])],
        "finish_reason": choice.get("finish_reason"),
    }


def token_ids(tokens: list[str]) -> list[int]:
    """Token ids of "token_id:N" strings (return_tokens_as_token_ids=true)."""
    return [int(t.split(":", 1)[1]) for t in tokens]


def max_logprob_diff(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    """Largest |logprob difference| over the top-k tokens of each position. A token in the
    top-k of one side only is scored with the smallest possible difference (its logprob
    minus the other side's k-th logprob, which bounds the unseen value from above): a tie
    swapped at rank k costs ~0, a real difference shows up. Different lengths give inf."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if not x and not y:
            continue
        if not x or not y:
            return float("inf")
        min_x, min_y = min(x.values()), min(y.values())
        for k in set(x) | set(y):
            if k in x and k in y:
                d = abs(x[k] - y[k])
            elif k in x:
                d = max(0.0, x[k] - min_y)
            else:
                d = max(0.0, y[k] - min_x)
            worst = max(worst, d)
    return worst


def rounds_of(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in the order benchmarks' --rounds runs them: the modes' order reversed
    every other round, so that no mode always runs first on a freshly warmed machine."""
    return [(rnd, mode) for rnd in range(rounds)
            for mode in (modes if rnd % 2 == 0 else modes[::-1])]  # fmt: skip


def median_run(runs: list[dict], value: Callable[[dict], float]) -> dict:
    """The benchmark run of median ``value`` (of an even number, the lower of the middle
    two): a run that was measured, not an average of two (benchmarks' --rounds)."""
    if not runs:
        raise ValueError("median_run: no runs")
    return sorted(runs, key=value)[(len(runs) - 1) // 2]


# ---------------------------------------------------------------------------- checks
def port_bindable(port: int, host: str = "127.0.0.1") -> bool:
    """True when a new server could listen on ``host:port`` now. SO_REUSEADDR is set, as
    uvicorn and the AFD FFN listener set it: closed connections in TIME_WAIT do not count,
    a socket still bound or listening there does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def group_rss_kib(pgid: int) -> int:
    """Sum of VmRSS (KiB) over the live processes of process group ``pgid`` (Linux)."""
    total = 0
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue  # exited meanwhile
    return total


def wait_for_exit(proc: subprocess.Popen, timeout: float) -> float | None:
    """Seconds until ``proc`` exits (0 when it already has), or None after ``timeout``."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - t0


def wait_for_log(
    log_path: str | os.PathLike,
    text: str,
    timeout: float,
    proc: subprocess.Popen | None = None,
    poll: float = 0.2,
) -> float | None:
    """Seconds until ``text`` appears in the log, or None after ``timeout`` or (when
    ``proc`` is given) once ``proc`` has exited without writing it."""
    t0 = time.monotonic()
    while True:
        try:
            if text in Path(log_path).read_text(errors="replace"):
                return time.monotonic() - t0
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            # one last look: the line may have been written just before the exit
            with contextlib.suppress(OSError):
                if text in Path(log_path).read_text(errors="replace"):
                    return time.monotonic() - t0
            return None
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(poll)
