"""Engine processes of ``afd_proc.py`` forked from one process that has imported vLLM.

Importing torch and vLLM (``from vllm import LLM``) takes 6-8 s of CPU of every engine
process on the 2-core CI machine, more than the tiny engine's own start (about 3 s) and
its generation (about 1 s); the CPU tests start some 80 such processes. A fork server
(this file run as a script, one per pytest process, started at its first use) imports them
once; each engine process is a fork of it that runs ``afd_proc.main()`` with its own
argv, environment (os.environ set exactly as given), session (process group), working
directory and log (stdout and stderr), as ``python afd_proc.py ...`` would.

Only what is read when a process runs, not when vLLM is imported, may differ between the
fork server's environment and an engine's (:data:`PER_ENGINE_KEYS`): another difference
(another ``TORCHDYNAMO_DISABLE``, a variable a test sets) gets a fork server of its own,
up to MAX_SERVERS; beyond them, and in a network namespace or on a GPU, an engine is
started by ``subprocess`` as before. ``AFD_TEST_FORK_ENGINES=0`` starts every engine so.

The client side (:func:`start`) returns a :class:`ForkedProcess`, which the harness uses
as it uses a ``subprocess.Popen``: pid, poll, wait (``subprocess.TimeoutExpired``),
returncode, send_signal, kill. The fork server reports each engine's exit status; once its
pipe closes (the pytest process ended), it SIGKILLs the process groups of the engines it
started and exits.

Protocol: one JSON object per line. Client -> server: ``{"argv", "env", "log", "cwd"}``;
server -> client: ``{"ready": true}`` (or ``{"unsafe": reason}`` and exit), ``{"pid": N}``
per request in order, ``{"exit": N, "rc": code}`` (Popen's returncode: -signal for a
signal).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

AFD_PROC = Path(__file__).resolve().with_name("afd_proc.py")
ENABLE_ENV = "AFD_TEST_FORK_ENGINES"
# Read by vLLM when the engine starts (vllm.envs reads lazily) or by the AFD overlay at
# connect time, or by nothing (pytest's name of the running test): they may differ per
# engine.
PER_ENGINE_KEYS = frozenset({"VLLM_PORT", "VLLM_MLA_DISABLE", "VLLM_AFD_SECRET",
                             "PYTEST_CURRENT_TEST"})


# ------------------------------------------------------------------------- server side
def serve() -> None:
    """The fork server's loop (this file as a script); does not return in a forked child:
    the child's SystemExit leaves through here to the interpreter's own exit."""
    # The replies go to the client on the pipe that was stdout; the server's own output
    # (vLLM's import logs) to stderr, and each child's to its log.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.path.insert(0, str(AFD_PROC.parent))
    import afd_proc  # noqa: F401  (what the engines run)

    from vllm import LLM, SamplingParams  # noqa: F401  (afd_proc's imports, done once)
    from vllm.afd import ffn_runner  # noqa: F401

    # A fork of a process with Python threads would hold their locks without them: fork
    # only from a server with none but its main thread. (The imports leave two native
    # threads, the idle pools of numpy's and OpenCV's OpenBLAS, which re-create them in a
    # child at fork; torch's OpenMP pool does not exist before a first parallel region.)
    threads = threading.active_count()
    if threads != 1:
        out.write(json.dumps({"unsafe": f"{threads} Python threads after the imports"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    me = os.getpid()
    children: set[int] = set()
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            for _ in sel.select(timeout=0.02):
                data = os.read(sys.stdin.fileno(), 65536)
                if not data:
                    return  # the client is gone: the finally below kills what is left
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    pid = os.fork()
                    if pid == 0:
                        out.close()
                        run_child(json.loads(line))  # raises SystemExit, never returns
                    children.add(pid)
                    out.write(json.dumps({"pid": pid}) + "\n")
                    out.flush()
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                rc = os.waitstatus_to_exitcode(status)
                out.write(json.dumps({"exit": pid, "rc": rc}) + "\n")
                out.flush()
    finally:
        if os.getpid() == me:
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass


def run_child(req: dict) -> None:
    """In the forked child: become ``python afd_proc.py ARGV`` with its environment,
    session and log, and exit with afd_proc.main()'s code (SystemExit: the interpreter's
    normal exit, with its atexit handlers and thread joins, as in a process of its own)."""
    os.setsid()
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = [str(AFD_PROC), *req["argv"]]
    import afd_proc

    sys.exit(afd_proc.main())


# ------------------------------------------------------------------------- client side
class ForkedProcess:
    """An engine process forked by the fork server, as a ``subprocess.Popen`` is used."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None
        self.exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """This pytest process's fork server (a child process), and its reader thread."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        # its own output (vLLM's import logs, a traceback should it fail) in a log of its own
        fd, self.log = tempfile.mkstemp(prefix="afd-engine-fork-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=self.env,
                                         start_new_session=True)  # fmt: skip
        self.lock = threading.Lock()  # one request at a time
        self.pids: list[int] = []
        self.got_pid = threading.Condition()
        self.procs: dict[int, ForkedProcess] = {}
        self.exits: dict[int, int] = {}
        first = self.proc.stdout.readline()
        msg = json.loads(first) if first else {"unsafe": f"it did not start (see {self.log})"}
        self.usable = bool(msg.get("ready"))
        self.why = msg.get("unsafe", "")
        if self.usable:
            threading.Thread(target=self.read, daemon=True, name="engine-fork-reader").start()

    def read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.got_pid:
                if "pid" in msg:
                    self.pids.append(msg["pid"])
                    self.got_pid.notify_all()
                elif "exit" in msg:
                    p = self.procs.get(msg["exit"])
                    if p is None:
                        self.exits[msg["exit"]] = msg["rc"]
                    else:
                        p.returncode = msg["rc"]
                        p.exited.set()
        with self.got_pid:  # the server ended: no request can be answered any more
            self.usable = False
            self.got_pid.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess | None:
        """An engine process, or None when the server cannot start one any more."""
        req = {"argv": argv, "env": env, "log": str(log), "cwd": os.getcwd()}
        with self.lock:
            with self.got_pid:
                if not self.usable:
                    return None
                try:
                    self.proc.stdin.write((json.dumps(req) + "\n").encode())
                    self.proc.stdin.flush()
                except OSError:
                    self.usable = False
                    return None
                deadline = time.monotonic() + 60
                while not self.pids and self.usable:
                    self.got_pid.wait(max(0.0, deadline - time.monotonic()))
                    if time.monotonic() > deadline:
                        raise RuntimeError("the engine fork server did not answer in 60 s")
                if not self.pids:
                    return None
                pid = self.pids.pop(0)
                p = ForkedProcess(self, pid, [sys.executable, str(AFD_PROC), *argv])
                self.procs[pid] = p
                if pid in self.exits:
                    p.returncode = self.exits.pop(pid)
                    p.exited.set()
                return p


# One fork server per environment (less PER_ENGINE_KEYS): a test that sets a variable of
# its own (monkeypatch) gets a server of its own, and the others keep theirs.
MAX_SERVERS = 2
SERVERS: dict[frozenset, ForkServer] = {}
SERVERS_LOCK = threading.Lock()


def server_env(env: dict[str, str]) -> dict[str, str]:
    """The fork server's environment for an engine of environment ``env``."""
    return {k: v for k, v in env.items() if k not in PER_ENGINE_KEYS}


def start(argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess | None:
    """``afd_proc.py ARGV`` forked from the fork server of its environment (started at its
    first use), its output appended to ``log``; None where it cannot be (disabled, a
    MAX_SERVERS+1-th environment, no usable server): the caller starts a process of its
    own."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    base = server_env(env)
    key = frozenset(base.items())
    with SERVERS_LOCK:
        server = SERVERS.get(key)
        if server is None:
            if len(SERVERS) >= MAX_SERVERS:
                return None
            server = SERVERS[key] = ForkServer(base)
            if not server.usable:
                print(f"engine fork server not used: {server.why}", file=sys.stderr)
    return server.fork(list(argv), dict(env), log)


if __name__ == "__main__":
    serve()
