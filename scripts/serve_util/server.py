"""One `vllm serve` process (:class:`Server`): start it in the engine environment, wait
for its health, query it, stop or kill it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve_util.client import completion, http_get
from serve_util.engine import engine_env, serve_command
from serve_util.logs import log_tail
from serve_util.procs import group_members, start_process, stop_process_group, stop_processes


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


def stop_servers(servers: list[Server | None], grace: float = 15.0) -> None:
    """Stop several servers at once (None entries are skipped)."""
    stop_processes([s.proc for s in servers if s is not None], grace)
