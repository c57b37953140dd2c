"""benchmarks/decode.py --mps: the MPS control daemon (benchmarks/mps.py) is told to quit
when the sweep ends by SIGTERM (run_gpu.sh bounds each benchmark with `timeout`), not only
when it returns: the sweep turns SIGTERM into SystemExit (serve_util.install_cleanup) and
the daemon's block unwinds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"

# A stand-in for nvidia-cuda-mps-control: `-d` records the start, a command on stdin is
# recorded and answered (get_server_list: an empty list).
FAKE_CONTROL = """#!/bin/sh
if [ "$1" = "-d" ]; then echo start >> "$AFD_FAKE_MPS_LOG"; exit 0; fi
read cmd
echo "$cmd" >> "$AFD_FAKE_MPS_LOG"
"""

# decode.py's sweep with a stand-in for one measurement (an engine start): it says it runs
# and waits, as a start does.
RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import decode

    def measure(*args, **kwargs):
        print("running", flush=True)
        time.sleep(60)

    decode.measure = measure
    sys.argv = ["decode.py", "--model", sys.argv[2], "--device", "cuda", "--mps",
                "--modes", "plain", "--batch", "1"]
    sys.exit(decode.main())
""")


def test_sigterm_during_a_sweep_stops_the_daemon(tmp_path):
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(FAKE_CONTROL)
    control.chmod(0o755)
    log = tmp_path / "control.log"
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "AFD_FAKE_MPS_LOG": str(log)}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(BENCH), str(tmp_path / "model")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        lines = []
        while not lines or lines[-1] != "running":
            line = proc.stdout.readline()
            assert line, (lines, proc.communicate(timeout=30)[1])
            lines.append(line.strip())
        assert any(x.endswith("(pipe /tmp/afd-mps-pipe)") for x in lines), lines
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    assert "MPS: control daemon stopped" in out, (out, err)
    assert log.read_text().split() == ["start", "get_server_list", "quit"]
