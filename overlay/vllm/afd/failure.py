# SPDX-License-Identifier: Apache-2.0
"""Why an AFD engine died, for the error that its clients get.

A lost AFD peer fails the worker process; vLLM then ends the engine core and
the API server answers every request with ``EngineDeadError``, whose text
says only "EngineCore encountered an issue". The AFD runtime therefore
records its failure in a small file (``<role>-<rank>-<pid>.error`` next to
the metrics snapshots, in the private directory of
:func:`vllm.afd.metrics.metrics_dir`) before the exception travels up, and
``EngineDeadError`` (patch ``engine-dead-peer``) appends the failure of its own server's
processes: the client reads e.g. "... AFD: lost AFD peer FFN rank 0 at
10.0.0.2:29600: connection closed". Since that text reaches clients it is
cleaned on the way in and out (:func:`clean_message`: no control or format
characters, at most :data:`MAX_MESSAGE_CHARS`).
"""

from __future__ import annotations

import json
import os
import time
import unicodedata

from vllm.afd.metrics import parent_pid, read_private_files, write_private_file

MAX_AGE_S = 3600.0
MAX_MESSAGE_CHARS = 500


def clean_message(text: str) -> str:
    """``text`` fit for a client's error message and a log line: control and format
    characters (line breaks, terminal escapes, bidirectional overrides) become spaces,
    runs of spaces one, and at most MAX_MESSAGE_CHARS characters are kept."""
    chars = (" " if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in text)
    out = " ".join("".join(chars).split())
    if len(out) > MAX_MESSAGE_CHARS:
        out = out[: MAX_MESSAGE_CHARS - 3] + "..."
    return out


def _ancestry(pid: int) -> list[int]:
    """``pid`` and its ancestors, up to and including pid 1: in a container the API
    server is often pid 1 (the entrypoint), and its failure lookup needs itself in the
    chain."""
    chain = []
    while pid and pid > 0 and len(chain) < 64:
        chain.append(pid)
        if pid == 1:
            break
        pid = parent_pid(pid)
    return chain


def record(role: str, rank: int, message: str) -> None:
    """Best effort: note this process's AFD failure (called before it raises on)."""
    rec = {"role": role, "rank": rank, "message": clean_message(message), "time": time.time(),
           "ancestry": _ancestry(os.getpid())}  # fmt: skip
    write_private_file(f"{role}-{rank}-{os.getpid()}.error", json.dumps(rec).encode())


def failure_of_this_server(pid: int | None = None) -> str | None:
    """The newest recorded AFD failure of ``pid`` (default: this process) or of
    a process it started, within the last hour; None when there is none."""
    pid = os.getpid() if pid is None else pid
    newest: tuple[float, str] | None = None
    now = time.time()
    for _, data in read_private_files(".error"):
        try:
            rec = json.loads(data)
            t, msg, chain = float(rec["time"]), str(rec["message"]), list(rec["ancestry"])
        except (ValueError, KeyError, TypeError):
            continue
        if pid in chain and now - t <= MAX_AGE_S and (newest is None or t > newest[0]):
            newest = (t, msg)
    return clean_message(newest[1]) if newest else None


def engine_dead_detail() -> str:
    """Suffix for vLLM's EngineDeadError message: the AFD reason, if any."""
    try:
        msg = failure_of_this_server()
    except Exception:  # noqa: BLE001 - never break the error path itself
        return ""
    return f" AFD: {msg}" if msg else ""


def exit_now(message: str) -> None:
    """End this process at once with status 1, after flushing the log (the
    failure is recorded already). For failures that leave a thread stuck
    where no exception can reach it: a GPU stream behind a device wait, or a
    micro-batch thread waiting for a hand-over that will never come."""
    import logging
    import sys

    release_cpu_shm()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


def release_cpu_shm() -> list[str]:
    """Unlink the shared-memory files of vLLM's CPU tensor-parallel communicator
    (``/dev/shm/<VLLM_DIST_IDENT>-tp:...-cpushm_<rank>``) of this server before an
    ``os._exit``, which skips their cleanup. A file left behind makes the next
    server with the same internal port fail at start ("create shm in SHMManager
    failed. errno: 17"). The name is only unlinked: a member still running keeps
    its mapping. No-op outside a CPU worker of a tensor-parallel server."""
    ident = os.environ.get("VLLM_DIST_IDENT")
    if not ident or not os.path.isdir("/dev/shm"):
        return []
    removed = []
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"{ident}-") and "-cpushm" in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except OSError:
                pass
    return removed
