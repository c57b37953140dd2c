"""benchmarks/serve.py reads the FFN server's graph captures from its log: each one stalls
every attention rank the FFN rank serves, so a serving figure is read with them."""

from __future__ import annotations

import serve  # benchmarks/serve.py

# Lines of an FFN server's log (one H200, DeepSeek-V2-Lite shape, 2026-12-04), between others.
LOG = """\
INFO 12-04 19:48:23 [engine.py:107] AFD FFN role: engine core ready (no KV cache, no scheduler)
INFO 12-04 19:48:33 [ffn_runner.py:560] AFD FFN role: captured a CUDA graph for step ((0, 256),) in 55.4 ms (1 graphs)
INFO 12-04 19:48:34 [ffn_runner.py:560] AFD FFN role: captured a CUDA graph for step ((0, 64),) in 66.4 ms (2 graphs)
WARNING 12-04 19:48:42 [tcp.py:1228] AFD: FFN rank 0 lost attention rank 0 (connection closed)
INFO 12-04 19:48:43 [ffn_runner.py:560] AFD FFN role: captured a CUDA graph for step ('ubatched', 0, 32, 32) in 70 ms (3 graphs)
"""  # noqa: E501


def test_every_capture_with_its_step_and_time():
    assert serve.ffn_captures(LOG) == [
        {"step": "((0, 256),)", "ms": 55.4},
        {"step": "((0, 64),)", "ms": 66.4},
        {"step": "('ubatched', 0, 32, 32)", "ms": 70.0},
    ]


def test_a_log_without_captures():
    # The CPU (no FFN graphs), or a GPU run with connector_extra_config.ffn_cuda_graphs off.
    assert serve.ffn_captures(LOG.splitlines()[0] + "\n") == []
