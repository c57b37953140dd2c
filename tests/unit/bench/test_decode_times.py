"""benchmarks/decode.py's TPOT from the engine's output steps (decode_times): first to last
token over the steps between, whatever the steps before every request's first token."""

from __future__ import annotations

import decode  # benchmarks/decode.py
import pytest


def test_lockstep_batch():
    # Prefill answered at 0.10 s, then a token for every request every 10 ms, one slow step.
    stamps = [(0.10, 1), (0.11, 2), (0.12, 3), (0.15, 4), (0.16, 5)]
    r = decode.decode_times(stamps, 5)
    assert r["first_token_s"] == 0.10
    assert r["tpot_s"] == pytest.approx(0.06 / 4)
    assert r["itl_median_s"] == pytest.approx(0.01)
    assert r["step_s"] == pytest.approx([0.01, 0.01, 0.03, 0.01])


def test_prefill_over_several_steps_and_steps_that_leave_the_slowest_request_behind():
    # A chunked prefill: the first outputs leave a request without a token (fewest 0); a
    # request admitted one step late keeps the fewest count one step behind to the end.
    stamps = [(0.05, 0), (0.09, 1), (0.10, 1), (0.12, 2), (0.13, 2), (0.15, 3)]
    r = decode.decode_times(stamps, 3)
    assert r["first_token_s"] == 0.09
    assert r["step_s"] == pytest.approx([0.03, 0.03])
    assert r["tpot_s"] == pytest.approx(0.03)


@pytest.mark.parametrize("stamps,n", [
    ([(0.1, 1), (0.2, 3)], 3),  # two tokens in one step: not one decode step each
    ([(0.1, 1), (0.2, 2)], 3),  # the run ended before every request had 3 tokens
    ([(0.1, 0), (0.2, 0)], 2),  # no request answered at all
])  # fmt: skip
def test_steps_that_do_not_advance_one_token_at_a_time_are_refused(stamps, n):
    with pytest.raises(ValueError, match="one token each step"):
        decode.decode_times(stamps, n)


def test_one_token_has_no_decode():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        decode.decode_times([(0.1, 1)], 1)
