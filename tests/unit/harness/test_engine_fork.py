"""The engine fork server of the CPU tests (tests/cpu/engine_fork.py): a forked
``afd_proc.py`` has its argv, its log, a session of its own and its exit status (a signal's
as subprocess gives it), as a process of its own would."""

from __future__ import annotations

import os
import signal
import subprocess

import engine_fork  # tests/cpu/engine_fork.py
import pytest

import serve_util as su

pytestmark = pytest.mark.timeout(300)  # the fork server's import of vLLM on 2 busy cores


@pytest.fixture
def env() -> dict[str, str]:
    return su.engine_env(in_process=True)


def test_exit_code_and_output_in_the_log(env, tmp_path):
    log = tmp_path / "bad.log"
    p = engine_fork.start(["no-such-mode", "--model", "m"], env, log)
    assert p is not None, "no fork server"
    assert p.wait(120) == 2 and p.poll() == 2 and p.returncode == 2
    text = log.read_text()
    assert "invalid choice: 'no-such-mode'" in text, text
    assert '{"pid"' not in text and '"ready"' not in text  # the server's replies stay its own


def test_session_wait_timeout_and_signal_status(env, tmp_path):
    fifo = tmp_path / "prompts.json"
    os.mkfifo(fifo)  # afd_proc.py plain opens its prompts first: it blocks here
    p = engine_fork.start(["plain", "--model", "m", "--prompts", str(fifo), "--out",
                           str(tmp_path / "o.json")], env, tmp_path / "plain.log")  # fmt: skip
    assert p is not None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(1.0)
    assert p.poll() is None
    assert os.getsid(p.pid) == p.pid and os.getpgid(p.pid) == p.pid
    assert su.group_members(p.pid) == [p.pid]
    p.send_signal(signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    assert su.group_members(p.pid) == []


def test_another_environment_beyond_the_limit_is_left_to_subprocess(env, tmp_path,
                                                                     monkeypatch):
    assert engine_fork.start(["no-such-mode"], env, tmp_path / "a.log").wait(120) == 2
    # a variable the fork server did not import with, and no room for another server
    monkeypatch.setattr(engine_fork, "MAX_SERVERS", len(engine_fork.SERVERS))
    assert engine_fork.start(["no-such-mode"], {**env, "SOME_OTHER": "1"},
                             tmp_path / "b.log") is None  # fmt: skip
    # per-engine keys do not count
    p = engine_fork.start(["no-such-mode"], {**env, "VLLM_PORT": "1", "VLLM_AFD_SECRET": "x"},
                          tmp_path / "c.log")  # fmt: skip
    assert p is not None and p.wait(120) == 2
    monkeypatch.setenv(engine_fork.ENABLE_ENV, "0")
    assert engine_fork.start(["no-such-mode"], env, tmp_path / "d.log") is None
