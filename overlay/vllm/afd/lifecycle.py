# SPDX-License-Identifier: Apache-2.0
"""An AFD server's processes end with the process that started them.

``vllm serve`` runs its engine core in a child process of the API server, and
the engine core its workers in children of its own. When the API server is
killed (SIGKILL, the OOM killer, a container runtime's custom stop), vLLM's
engine core does not notice: it waits on its ZMQ sockets for ever, and so do
its workers (their death pipe watches the engine core only). For AFD that
leaves an FFN rank serving its attention servers, its AFD port bound (a
restarted FFN server cannot listen), and the attention side never told.

:func:`watch_parent` (hooked at the start of the engine-core and worker
processes of an AFD server, patch ``end-with-parent``) starts a thread that polls the
process's parent every :data:`POLL_S`; once the parent is gone (the process
was re-parented to init or a subreaper) it records the failure, releases
what an ``os._exit`` would leave behind (vLLM's CPU shared-memory files, the
metrics snapshot) and ends the process with status 1. Its sockets close with
it: the AFD port is free again and the peer role sees the connection drop,
exactly as when the whole server is killed. An engine core's exit then ends
its workers the same way, one poll later.

Only a process started through :mod:`multiprocessing` is watched: the
process a user or a supervisor started (the API server, or an engine with
the engine core in-process) goes on when its own launcher exits.
"""

from __future__ import annotations

import multiprocessing
import os
import threading

from vllm.logger import init_logger

logger = init_logger(__name__)

POLL_S = 0.5

_lock = threading.Lock()
_watcher: threading.Thread | None = None


def watch_parent(vllm_config, process_name: str) -> bool:
    """Hook at the start of an engine-core or worker process: end this process
    when its parent dies. No-op outside AFD and in a process not started by
    :mod:`multiprocessing`. True when a watch runs (idempotent)."""
    cfg = getattr(vllm_config, "afd_config", None)
    parent = multiprocessing.parent_process()
    if cfg is None or parent is None or parent.pid is None:
        return False
    rank = cfg.resolved_rank(getattr(vllm_config.parallel_config, "data_parallel_rank", 0))
    return start_watch(parent.pid, cfg.role, rank, process_name)


def start_watch(
    parent_pid: int, role: str, rank: int, process_name: str, poll_s: float = POLL_S
) -> bool:
    """Watch ``parent_pid`` (this process's parent when it started) from a daemon
    thread; once ``os.getppid()`` differs from it, :func:`end_orphan`."""
    global _watcher
    with _lock:
        if _watcher is not None:
            return True
        _watcher = threading.Thread(
            target=_watch, args=(parent_pid, role, rank, process_name, poll_s),
            name="afd-parent-watch", daemon=True,
        )  # fmt: skip
        _watcher.start()
    logger.debug("AFD %s: ends when its parent (pid %d) dies", process_name, parent_pid)
    return True


def _watch(parent_pid: int, role: str, rank: int, process_name: str, poll_s: float) -> None:
    stop = threading.Event()  # never set: the thread ends with the process
    while os.getppid() == parent_pid:
        stop.wait(poll_s)
    end_orphan(parent_pid, role, rank, process_name)


def orphan_message(parent_pid: int, process_name: str) -> str:
    return (
        f"the process that started this {process_name} (pid {parent_pid}) died; "
        "ending it so that its AFD port and peer connections are released"
    )


def end_orphan(parent_pid: int, role: str, rank: int, process_name: str) -> None:
    """Record why, release what ``os._exit`` skips, and end this process (status 1)."""
    from vllm.afd import failure, metrics

    message = orphan_message(parent_pid, process_name)
    logger.error("AFD %s rank %d: %s", role, rank, message)
    failure.record(role, rank, message)
    metrics.STATS.close()
    failure.exit_now(message)
