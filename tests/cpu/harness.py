"""The test harness of the AFD end-to-end tests: one class for an engine process of
``afd_proc.py`` (plain vLLM, an AFD attention rank or an AFD FFN server), the ``procs``
fixture that stops them, and the helpers around them and around ``vllm serve`` pairs.

Every engine these tests start, an ``afd_proc.py`` process here or a ``vllm serve`` server
(``serve_util.Server``), gets its environment from one builder, ``serve_util.engine_env``,
and runs in a session of its own started by ``serve_util.start_process`` (stopped as a
process group by ``serve_util.stop_process_group``). Used by the CPU oracle, fault, netns,
soak, serve and observability tests and by the GPU oracle (tests/gpu).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import engine_fork
import pytest
from oracle_lib import PROMPTS, write_prompts

import serve_util as su

AFD_PROC = Path(__file__).resolve().with_name("afd_proc.py")


def free_afd_port(ranks: int = 1) -> int:
    """An AFD base port with ``ranks`` consecutive free ports (FFN rank f listens on
    ``port + f``), below the ephemeral range."""
    return su.free_ports(ranks, consecutive=True)[0]


def afd_json(role: str, port: int, **extra) -> str:
    """The ``--afd`` argument of ``afd_proc.py``: serve_util.afd_config as JSON (gloo on
    127.0.0.1, timeout_s 120, one rank of each role unless ``extra`` says otherwise)."""
    return json.dumps(su.afd_config(role, port, **extra))


def cpu_shm_files(vllm_port: int) -> list[str]:
    """Shared-memory files of vLLM's CPU tensor-parallel communicator
    (``<VLLM_DIST_IDENT>-tp:0-[0-1]-cpushm_<rank>``; the ident is the server's
    distributed-init port: its VLLM_PORT, or the next free port above it)."""
    if not os.path.isdir("/dev/shm"):
        return []
    out = []
    for name in os.listdir("/dev/shm"):
        head = name.split("-", 1)[0]
        if "-cpushm" in name and head.isdigit() and vllm_port <= int(head) < vllm_port + 100:
            out.append(name)
    return sorted(out)


class AfdProc:
    """``afd_proc.py MODE --model MODEL ARGS``: one engine in a process of its own (engine
    core in-process), in a session of its own so that its process group holds its workers;
    stdout and stderr go to ``log``.

    ``env`` is added to serve_util.engine_env (``device`` "cpu": a DeepSeek model runs
    without MLA; any other device: no CPU-only setting but the small KV cache, which CUDA
    ignores). ``netns``: run it in that network namespace (``ip netns exec`` execs the
    command, so the pid and the session stay the ones started here).
    """

    def __init__(
        self,
        mode: str,
        model: str | os.PathLike,
        log: str | os.PathLike,
        args: Sequence[str] = (),
        *,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        device: str = "cpu",
    ):
        self.mode = mode
        self.log = Path(log)
        args = list(args)
        self.out = Path(args[args.index("--out") + 1]) if "--out" in args else None
        self.env = su.engine_env(model if device == "cpu" else None, in_process=True, extra=env)
        self.vllm_port = int(self.env["VLLM_PORT"])
        # A server killed earlier (here or by an earlier run) leaves its files behind,
        # and a tensor-parallel server of the same internal port would then fail at
        # start (EEXIST). No live server of this process has this port base.
        for name in cpu_shm_files(self.vllm_port):
            Path("/dev/shm", name).unlink(missing_ok=True)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        argv = [mode, "--model", str(model), *args]
        cmd = [*prefix, sys.executable, str(AFD_PROC), *argv]
        self.log.unlink(missing_ok=True)  # the log holds this process only
        # On the CPU, outside a namespace: forked from the engine fork server, which has
        # imported vLLM once (engine_fork.py); else, or where it cannot, a new process.
        forked = None
        if device == "cpu" and not netns:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self.log.write_text("$ (forked) " + " ".join(cmd) + "\n")
            forked = engine_fork.start(argv, self.env, self.log)
            if forked is None:
                self.log.unlink()
        self.p = forked or su.start_process(cmd, self.log, self.env)

    @property
    def pid(self) -> int:
        return self.p.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        """For a failure report: the log's root cause and last ``n`` lines."""
        return su.failure_excerpt(self.log, n)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None while it still runs after ``timeout`` seconds."""
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float) -> int:
        """The exit code; a process still running after ``timeout`` seconds is killed and
        fails the test with its log."""
        rc = self.wait_exit(timeout)
        if rc is None:
            self.kill()
            pytest.fail(f"{self.log.name} did not finish within {timeout} s:\n{self.tail()}")
        return rc

    def output(self, timeout: float) -> dict:
        """What the process wrote to its ``--out`` file, once it ended with exit code 0
        (waited for as by ``wait``; another exit code fails the test with its log)."""
        rc = self.wait(timeout)
        assert rc == 0, f"{self.log.name}: afd_proc.py {self.mode} failed (rc={rc}):\n{self.tail()}"
        return json.loads(self.out.read_text())

    def wait_for_log(self, text: str, timeout: float, poll: float = 0.2) -> float | None:
        """Seconds until ``text`` is in the log; None after ``timeout`` or once the process
        exited without writing it."""
        return su.wait_for_log(self.log, text, timeout, proc=self.p, poll=poll)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 30.0) -> int | None:
        """``sig`` to the process group, SIGKILL to what is left after ``grace`` seconds;
        returns when no process of the group is left, with the exit code."""
        return su.stop_process_group(self.p, grace=grace, sig=sig)

    def kill(self) -> int | None:
        """SIGKILL to the whole process group (a crash, as far as a peer can tell)."""
        return self.stop(signal.SIGKILL)

    def gone(self) -> bool:
        """True when no process of its group is left."""
        return self.p.poll() is not None and not su.group_members(self.pid)


def module_log_dir(name: str):
    """A module-scoped ``log_dir`` fixture: a new folder ``name`` for the servers' logs of
    one test module, its path printed (``log_dir = module_log_dir("afd_restart_logs")``)."""

    @pytest.fixture(scope="module")
    def log_dir(tmp_path_factory) -> Path:
        path = tmp_path_factory.mktemp(name)
        print(f"server logs: {path}")
        return path

    return log_dir


@pytest.fixture
def procs():
    """The AfdProcs a test starts (append each): all are stopped at the end (SIGTERM, one
    shared 30 s grace, then SIGKILL), and none may leave a process behind."""
    started: list[AfdProc] = []
    yield started
    su.stop_processes([p.p for p in started], grace=30.0)
    left = {p.log.name: su.group_members(p.pid) for p in started}
    assert not any(left.values()), f"processes left: {left}"


def ffn_stopped_counts(ffn: AfdProc) -> dict[str, int]:
    """Stop an FFN server (SIGTERM) and read its AFD-FFN-STOPPED line (steps served...)."""
    ffn.stop()
    stopped = [ln for ln in ffn.text().splitlines() if ln.startswith("AFD-FFN-STOPPED")]
    assert stopped, ffn.tail()
    return {k: int(v) for k, v in (f.split("=") for f in stopped[0].split()[1:])}


def wait_for(pred, timeout: float, what: str, poll: float = 0.2):
    """``pred()``'s first truthy value, polled every ``poll`` s; fails the test when
    ``what`` is not reached within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(poll)
    return got


def wait_log(srv: su.Server, text: str, timeout: float, count: int = 1) -> str:
    """The ``count``-th log line of ``srv`` holding ``text`` (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [ln for ln in srv.log_path.read_text(errors="replace").splitlines()
                 if text in ln]  # fmt: skip
        if len(lines) >= count:
            return lines[count - 1]
        srv.check_alive()
        assert time.monotonic() < deadline, (
            f"{srv.name}: no {text!r} in {timeout} s:\n{srv.log_tail()}")
        time.sleep(0.1)


def request_after_peer_loss(srv: su.Server, timeout: float) -> str:
    """A new request to a server whose AFD peer is gone fails fast: an HTTP 5xx, or a
    connection refused or reset (the server on its way out). A request still unanswered
    after ``timeout`` s fails the test. Returns the outcome, for the test's output."""
    try:
        status, body = srv.completion("Hello", max_tokens=4, timeout=timeout)
    except OSError as e:  # urllib's URLError and a socket timeout are OSErrors too
        hung = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
        assert not hung, f"the request hung for {timeout} s: {e!r}"
        return f"{type(e).__name__}: {e}"
    assert status >= 500, f"HTTP {status} with the AFD peer gone: {body}"
    return f"HTTP {status}: {su.error_message(body)[:200]}"


def afd_metrics(srv: su.Server) -> dict[str, float]:
    """The AFD series of ``srv``'s /metrics: series as printed (name and labels) -> value."""
    status, text = su.http_get(f"{srv.url}/metrics", timeout=10)
    assert status == 200, f"{srv.name} /metrics: HTTP {status}: {text[:500]}"
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:afd_"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def wait_healthy(servers: list[su.Server], timeout: float) -> dict[str, float]:
    """serve_util.wait_all_healthy; a server that exits or is not healthy in time fails the
    test with the first traceback of every server's log (the root cause sits far above
    vLLM's re-raise) and the log tail of the one that failed."""
    try:
        return su.wait_all_healthy(servers, timeout=timeout)
    except su.ServerDied as e:
        tbs = [f"--- first traceback of the {s.name} server ({s.log_path}):\n"
               f"{su.find_traceback(s.log_path)}" for s in servers]  # fmt: skip
        pytest.fail("\n".join(tbs) + f"\n\n--- {e}", pytrace=False)


class TokenStream(threading.Thread):
    """One greedy streaming completion of ``max_tokens`` tokens from ``srv`` (ignore_eos,
    token ids in the chunks), started at once; ``ids``: the token ids of its chunks, in
    order; ``top``: per token its ``logprobs`` most likely tokens as {token id (str):
    logprob}, afd_proc.py's form; ``times``: when each chunk with tokens arrived
    (time.monotonic); ``result``: su.stream_completion's once it ended, at ``ended_at``."""

    PARAMS = {"temperature": 0.0, "ignore_eos": True, "return_tokens_as_token_ids": True,
              "logprobs": 1}  # fmt: skip

    def __init__(self, srv: su.Server, prompt: str, max_tokens: int, timeout: float = 240,
                 logprobs: int = 1):  # fmt: skip
        super().__init__(daemon=True)
        self.srv, self.prompt, self.max_tokens, self.timeout = srv, prompt, max_tokens, timeout
        self.params = {**self.PARAMS, "logprobs": logprobs}
        self.ids: list[int] = []
        self.top: list[dict[str, float]] = []
        self.times: list[float] = []
        self.result: dict | None = None
        self.ended_at: float | None = None
        self.start()

    def run(self):
        def on_chunk(chunk):
            for choice in chunk.get("choices") or []:
                logprobs = choice.get("logprobs") or {}
                ids = su.token_ids(logprobs.get("tokens") or [])
                self.top += [{str(su.token_ids([t])[0]): lp for t, lp in (top or {}).items()}
                             for top in logprobs.get("top_logprobs") or []]  # fmt: skip
                if ids:
                    self.times.append(time.monotonic())
                self.ids += ids

        self.result = su.stream_completion(self.srv.url, self.prompt,
                                           max_tokens=self.max_tokens, timeout=self.timeout,
                                           on_chunk=on_chunk, **self.params)  # fmt: skip
        self.ended_at = time.monotonic()


def join_streams(streams: Sequence[TokenStream], timeout: float) -> list[TokenStream]:
    """Waits up to ``timeout`` s in all for ``streams`` to end; those still running."""
    deadline = time.monotonic() + timeout
    for s in streams:
        s.join(max(0.0, deadline - time.monotonic()))
    return [s for s in streams if s.is_alive()]


def first_token_after(streams: Sequence[TokenStream], t: float) -> float | None:
    """When the first chunk with tokens after ``t`` (time.monotonic) arrived, on any stream."""
    return min((x for s in streams for x in s.times if x > t), default=None)


def start_plain(model_dir: Path, directory: Path, spec: dict = PROMPTS, max_num_seqs: int = 8,
                args: Sequence[str] = (), *, device: str = "cpu",
                env: dict[str, str] | None = None) -> AfdProc:  # fmt: skip
    """Plain vLLM on ``spec``'s prompts (oracle_lib.PROMPTS by default; ``afd_proc.py
    plain``, with ``args``) in a process of its own: the prompts in ``directory``/prompts.json,
    its output in plain.json, its log in plain.log; ``device`` and ``env`` as for AfdProc (a
    GPU test: "cuda", its GPU)."""
    prompts = write_prompts(directory, spec)
    return AfdProc("plain", model_dir, directory / "plain.log",
                   ["--prompts", str(prompts), "--out", str(directory / "plain.json"),
                    "--max-num-seqs", str(max_num_seqs), *args],
                   env=env, device=device)  # fmt: skip
