"""CUDA MPS for the benchmarks: two AFD roles (or several replicas) running at once on one GPU.

Without MPS the processes sharing a GPU time-slice it, and an AFD hand-over waits for a
slice (docs/benchmarks.md). With the MPS control daemon running, their kernels run
concurrently. The daemon changes no setting of the device: it is started here with pipe and
log directories under /tmp, every process of the run sees the same
``CUDA_MPS_PIPE_DIRECTORY``, and it is told to quit at the end.

    # as a context manager (benchmarks/decode.py --mps, benchmarks/serve.py --mps):
    with mps.daemon(True) as env: ...  # env: the variables every child must see
    # from a shell (scripts/gpu/run_gpu.sh MPS=1):
    eval "$(python3 benchmarks/mps.py start)"; ...; python3 benchmarks/mps.py stop
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PIPE_DIR = "/tmp/afd-mps-pipe"
LOG_DIR = "/tmp/afd-mps-log"
CONTROL = "nvidia-cuda-mps-control"
# Where the GPU host keeps the driver's tools when they are not on PATH.
EXTRA_PATHS = ("/usr/local/nvidia/bin", "/usr/bin")


class MPSError(RuntimeError):
    pass


def mps_env(pipe_dir: str = PIPE_DIR, log_dir: str = LOG_DIR) -> dict[str, str]:
    return {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}


def control_binary() -> str:
    found = shutil.which(CONTROL)
    if found:
        return found
    for d in EXTRA_PATHS:
        path = Path(d) / CONTROL
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise MPSError(
        f"{CONTROL} not found on PATH or in {', '.join(EXTRA_PATHS)}: this host "
        "cannot run CUDA MPS; run without --mps (the roles then time-slice the GPU)"
    )


def _control(binary: str, env: dict[str, str], command: str, timeout: float = 10.0) -> str:
    try:
        r = subprocess.run(
            [binary],
            input=command + "\n",
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise MPSError(f"{CONTROL}: no answer to {command!r} within {timeout:g} s") from None
    if r.returncode != 0:
        raise MPSError(
            f"{CONTROL} {command!r} failed (rc={r.returncode}): {(r.stderr or r.stdout).strip()}"
        )
    return r.stdout


def start(pipe_dir: str = PIPE_DIR, log_dir: str = LOG_DIR) -> dict[str, str]:
    """Start the control daemon and check that it answers; returns the environment every
    process of the run must see. Raises MPSError with the daemon's log when it cannot."""
    binary = control_binary()
    env = mps_env(pipe_dir, log_dir)
    for d in (pipe_dir, log_dir):
        Path(d).mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [binary, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=30
    )
    if r.returncode != 0:
        raise MPSError(
            f"{CONTROL} -d failed (rc={r.returncode}): "
            f"{(r.stderr or r.stdout).strip()}{log_tail(log_dir)}"
        )
    deadline = time.monotonic() + 10.0
    while True:
        try:
            _control(binary, env, "get_server_list")
            return env
        except MPSError as e:
            if time.monotonic() > deadline:
                raise MPSError(
                    f"MPS control daemon started but does not answer: {e}{log_tail(log_dir)}"
                ) from None
            time.sleep(0.2)


def stop(env: dict[str, str] | None = None) -> None:
    """Tell the control daemon to quit (it can take a while when a client process
    is still ending: seen on an H200 past 10 s)."""
    env = env or mps_env()
    _control(control_binary(), env, "quit", timeout=60.0)


def log_tail(log_dir: str, n: int = 10) -> str:
    path = Path(log_dir) / "control.log"
    if not path.is_file():
        return ""
    lines = path.read_text(errors="replace").splitlines()[-n:]
    return "\n" + "\n".join(f"  {line}" for line in lines)


@contextlib.contextmanager
def daemon(enabled: bool) -> Iterator[dict[str, str]]:
    """MPS for the duration of the block when ``enabled`` (its environment, to pass to
    every child), else nothing ({}). The daemon is told to quit when the block unwinds: a
    caller bounded by run_gpu.sh's `timeout` turns SIGTERM into SystemExit
    (serve_util.install_cleanup, as benchmarks/decode.py and serve.py do); otherwise the
    daemon outlives the run and the next ``-d`` fails ("An instance of this daemon is
    already running")."""
    if not enabled:
        yield {}
        return
    env = start()
    print(f"MPS: control daemon started (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})", flush=True)
    try:
        yield env
    finally:
        try:
            stop(env)
            print("MPS: control daemon stopped", flush=True)
        except MPSError as e:
            print(f"MPS: could not stop the control daemon: {e}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["start"]:
        try:
            env = start()
        except MPSError as e:
            print(f"echo 'MPS: {e}' >&2; false")
            return 1
        print("export " + " ".join(f"{k}={v}" for k, v in env.items()))
        return 0
    if argv[:1] == ["stop"]:
        try:
            stop()
        except MPSError as e:
            print(f"MPS: {e}", file=sys.stderr)
            return 1
        return 0
    print("usage: mps.py start|stop", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
