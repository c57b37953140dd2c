"""Processes: start one in a process group of its own with its output in a log, stop a
group (SIGTERM, then SIGKILL), stop everything started at exit, and look at a group's
members."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

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
