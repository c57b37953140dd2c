"""The oracle's comparisons on synthetic outputs (what they accept and refuse)."""

from __future__ import annotations

import oracle_lib  # tests/cpu/oracle_lib.py
import pytest


def _out(*steps):
    """steps: (chosen token, {token: logprob}) per position."""
    return {"token_ids": [t for t, _ in steps],
            "logprobs": [{str(k): v for k, v in lp.items()} for _, lp in steps]}  # fmt: skip


def _run(*outs):
    return {"outputs": list(outs)}


PLAIN = _run(_out((1, {1: -0.5, 2: -1.0}), (3, {3: -0.7, 4: -0.7}), (5, {5: -0.1, 6: -3.0})))


def test_exact_match_passes():
    assert oracle_lib.assert_outputs_match(PLAIN, PLAIN, [3], 1e-6) == 0.0


def test_exact_refuses_a_tie_taken_the_other_way():
    other = _run(_out((1, {1: -0.5, 2: -1.0}), (4, {3: -0.7, 4: -0.7}), (7, {7: -0.1})))
    with pytest.raises(AssertionError, match="tokens differ"):
        oracle_lib.assert_outputs_match(PLAIN, other, [3], 0.1)


def test_ties_accept_the_other_tied_token_and_stop():
    # Position 1 is a tie in plain (margin 0): the other choice is fine, and what
    # follows (another context) is not compared.
    other = _run(_out((1, {1: -0.52, 2: -1.0}), (4, {3: -0.7, 4: -0.7}), (7, {7: -0.1})))
    worst, ties = oracle_lib.assert_outputs_match_up_to_ties(PLAIN, other, 0.1)
    assert ties == 1 and worst == pytest.approx(0.02)


def test_ties_refuse_a_real_divergence():
    other = _run(_out((2, {1: -0.5, 2: -1.0}), (3, {3: -0.7}), (5, {5: -0.1})))
    with pytest.raises(AssertionError, match="tokens differ by 0.5"):
        oracle_lib.assert_outputs_match_up_to_ties(PLAIN, other, 0.1)


def test_ties_refuse_logprobs_off_by_more_than_tol():
    other = _run(_out((1, {1: -0.8, 2: -1.0}), (3, {3: -0.7, 4: -0.7}), (5, {5: -0.1})))
    with pytest.raises(AssertionError, match=r"max \|logprob diff\|"):
        oracle_lib.assert_outputs_match_up_to_ties(PLAIN, other, 0.1)


def test_ties_refuse_a_token_outside_plains_top_k():
    other = _run(_out((9, {9: -0.5}), (3, {3: -0.7}), (5, {5: -0.1})))
    with pytest.raises(AssertionError, match="not in plain's top-k"):
        oracle_lib.assert_outputs_match_up_to_ties(PLAIN, other, 0.1)
