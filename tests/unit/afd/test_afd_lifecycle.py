"""An AFD process started through multiprocessing ends with its parent (vllm.afd.lifecycle;
the `vllm serve` case is tests/cpu/test_afd_orphans.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
from overlay_import import child_env

from vllm.afd import lifecycle

ORPHAN_EXIT_S = 5.0


# A parent that starts a forked child which installs the watch (as an engine core or a
# worker of an AFD server does) and then blocks; the parent prints the child's pid.
PARENT = textwrap.dedent("""
    import multiprocessing, sys, time
    from types import SimpleNamespace

    import overlay_import  # the AFD modules as they are in the tree

    overlay_import.install()

    def child(ready):
        from vllm.afd import lifecycle
        cfg = SimpleNamespace(
            afd_config=SimpleNamespace(role="ffn", resolved_rank=lambda dp: dp),
            parallel_config=SimpleNamespace(data_parallel_rank=0),
        )
        ready.put(lifecycle.watch_parent(cfg, "worker 0"))
        time.sleep(600)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("fork")
        ready = ctx.Queue()
        p = ctx.Process(target=child, args=(ready,))
        p.start()
        print(p.pid, ready.get(timeout=120), flush=True)
        time.sleep(600)
""")


@pytest.fixture
def mdir(tmp_path, monkeypatch):
    path = tmp_path / "afd-metrics"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("VLLM_AFD_METRICS_DIR", str(path))
    return path


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_watched_child_ends_when_its_parent_is_killed(mdir):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE,
                              text=True, env=child_env())  # fmt: skip
    child = None
    try:
        pid, watching = parent.stdout.readline().split()
        assert watching == "True"
        child = psutil.Process(int(pid))
        assert child.ppid() == parent.pid
        t_kill = time.monotonic()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        while not gone(child) and time.monotonic() - t_kill < ORPHAN_EXIT_S:
            time.sleep(0.02)
        took = time.monotonic() - t_kill
        assert gone(child), f"the child still runs {ORPHAN_EXIT_S} s after its parent died"
        print(f"orphaned child exited {took:.2f} s after its parent was killed")
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait(10)
        if child is not None and not gone(child):
            child.kill()
    # it said why, where the API server looks for the reason of a dead engine
    rec = json.loads((mdir / f"ffn-0-{child.pid}.error").read_text())
    assert rec["message"] == lifecycle.orphan_message(parent.pid, "worker 0")


def test_no_watch_outside_afd_or_in_a_process_not_started_by_multiprocessing():
    cfg = SimpleNamespace(
        afd_config=SimpleNamespace(role="ffn", resolved_rank=lambda dp: 0),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )
    # this test process was started by pytest's launcher, not by multiprocessing: a
    # process a user or a supervisor started goes on when its own launcher exits
    assert lifecycle.watch_parent(cfg, "EngineCore") is False
    assert lifecycle.watch_parent(SimpleNamespace(afd_config=None), "EngineCore") is False
    assert not any(t.name == "afd-parent-watch" for t in threading.enumerate())


# A forked child that connects the attention role (as vLLM's engine core process does, with
# a connector that only records) and returns: multiprocessing ends it with os._exit.
ENGINE_CORE = textwrap.dedent("""
    import multiprocessing, os, sys
    from types import SimpleNamespace

    import overlay_import  # the AFD modules as they are in the tree

    overlay_import.install()

    def child():
        import threading
        import torch
        from vllm.afd import attention, metrics

        class Connector:
            on_failure = None
            def connect(self): pass
            def shares_device(self): return False
            def close(self):
                if sys.argv[1] == "hangs":  # a lock held by a thread stuck in an exchange
                    threading.Event().wait()
                print("connector closed", flush=True)

        attention.CLOSE_AT_EXIT_S = 1.0
        attention.create_attention_connector = lambda ctx: Connector()
        afd = SimpleNamespace(
            role="attention", is_attention=True, resolved_rank=lambda dp: 0, connector="gloo",
            connector_extra_config={}, timeout_s=30.0, rejoin_timeout_s=0.0,
        )
        cfg = SimpleNamespace(
            afd_config=afd,
            parallel_config=SimpleNamespace(data_parallel_rank=0, enable_dbo=False),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
            device_config=SimpleNamespace(device=torch.device("cpu")),
        )
        attention.CLIENT.connect(cfg, {}, None)
        print("snapshots", sorted(os.listdir(metrics.metrics_dir())), flush=True)

    if __name__ == "__main__":
        p = multiprocessing.get_context("fork").Process(target=child)
        p.start()
        p.join(60)
        print("child exit", p.exitcode, flush=True)
""")


@pytest.mark.parametrize("close", ["closes", "hangs"])
def test_a_forked_engine_core_closes_the_attention_role_when_it_exits(mdir, close):
    """On a GPU host vLLM's engine core is a forked multiprocessing child (on the CPU vLLM
    spawns it), which ends with os._exit and runs no atexit hook: the attention role's close
    (its goodbye to the FFN rank) and the removal of its metrics snapshot run all the same,
    from multiprocessing's exit hook; a close that cannot finish (a lock held by a stuck
    thread) delays the exit by CLOSE_AT_EXIT_S at most."""
    out = subprocess.run([sys.executable, "-c", ENGINE_CORE, close], capture_output=True,
                         text=True, env=child_env(), timeout=120)  # fmt: skip
    text = out.stdout + out.stderr
    assert "child exit 0" in text and "snapshots ['attention-0-" in text, text
    if close == "closes":
        assert "connector closed" in text, text
    else:  # bounded: the process ends without the goodbye, and says so
        assert "connector closed" not in text, text
        assert "did not close within 1 s of the process's exit" in text, text
    assert not list(mdir.glob("attention-0-*.json")), list(mdir.iterdir())
