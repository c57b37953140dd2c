"""The per-test time limits (tests/timeouts.py, pytest-timeout with pyproject's settings)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import timeouts

REPO_ROOT = Path(__file__).resolve().parents[3]
UNIT = REPO_ROOT / "tests" / "unit" / "test_x.py"
CPU = REPO_ROOT / "tests" / "cpu" / "test_x.py"


def test_unit_tests_get_the_short_limit_unless_marked_long():
    assert timeouts.unit_timeout(UNIT, []) == timeouts.UNIT_TIMEOUT_S
    assert timeouts.unit_timeout(UNIT, ["parametrize"]) == timeouts.UNIT_TIMEOUT_S
    for long in ("slow", "cpu_e2e", "gpu"):
        assert timeouts.unit_timeout(UNIT, [long]) is None  # pyproject's 600 s
    assert timeouts.unit_timeout(UNIT, ["timeout"]) is None  # the test's own limit


def test_other_directories_keep_the_configured_limit():
    assert timeouts.unit_timeout(CPU, []) is None
    assert timeouts.unit_timeout(REPO_ROOT / "tests" / "gpu" / "test_x.py", []) is None
    assert timeouts.unit_timeout(Path("/elsewhere/tests/unit/test_x.py"), []) is None


def test_this_run_applies_the_limits(request):
    """This test (under tests/unit, not marked long) runs with the short limit, unless the
    run was given a limit of its own."""
    marks = [m.args for m in request.node.iter_markers("timeout")]
    if timeouts.limit_given_for_the_run(request.config):
        assert marks == []
    else:
        assert marks == [(timeouts.UNIT_TIMEOUT_S,)]
    assert request.config.getini("timeout_method") == "signal"
    assert float(request.config.getini("timeout")) == 600


HANGING = textwrap.dedent('''
    import subprocess, sys
    from pathlib import Path

    import pytest


    @pytest.fixture
    def child(tmp_path):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        yield p
        p.kill()
        p.wait()
        (Path(__file__).parent / "torn_down").write_text(str(p.returncode))


    def test_hangs_on_a_child(child):
        child.wait()
''')


def test_a_hanging_test_fails_with_its_stacks_and_is_torn_down(tmp_path):
    """With pyproject's settings (signal method), a test blocked waiting on a child process
    fails at its limit with the stacks dumped, and its teardown runs (a fixture that
    started a server stops it)."""
    test_file = tmp_path / "test_hang.py"
    test_file.write_text(HANGING)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(REPO_ROOT), "--timeout", "2",
         str(test_file)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Failed: Timeout (>2.0s) from pytest-timeout" in out, out
    assert "child.wait()" in out, out  # the stack of the hung test
    assert "1 failed" in out, out
    assert (tmp_path / "torn_down").read_text() == "-9", out
