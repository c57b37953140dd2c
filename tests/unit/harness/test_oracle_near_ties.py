"""oracle_lib.near_tie_divergences (the GPU oracle's DBO case on the q-LoRA DeepSeek-V2 checkpoint) and
oracle_lib.mixed_length_prompts, on synthetic outputs: what they accept and refuse."""

from __future__ import annotations

import oracle_lib  # tests/cpu/oracle_lib.py
import pytest


def _out(*steps):
    """steps: (chosen token, {token: logprob}) per position."""
    return {"token_ids": [t for t, _ in steps],
            "logprobs": [{str(k): v for k, v in lp.items()} for _, lp in steps]}  # fmt: skip


def _run(*outs):
    return {"outputs": list(outs)}


# Position 1 is a near-tie in plain (top two 0.03 apart), position 2 is not.
P = _out((1, {1: -0.5, 2: -1.0, 3: -2.0}), (3, {3: -0.70, 4: -0.73, 5: -0.9}),
         (5, {5: -0.1, 6: -3.0}))  # fmt: skip
PLAIN = _run(P, P)


def test_identical_outputs_have_no_divergence():
    divs, worst, equal = oracle_lib.near_tie_divergences(PLAIN, PLAIN, 0.1, 0.05)
    assert divs == [] and worst == 0.0 and equal == 6


def test_a_near_tie_taken_the_other_way_is_reported_and_ends_the_prompt():
    other = _out((1, {1: -0.51, 2: -1.0}), (4, {3: -0.72, 4: -0.71}), (9, {9: -0.1}))
    divs, worst, equal = oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.1, 0.05)
    assert [(i, pos) for i, pos, _ in divs] == [(1, 1)]
    assert divs[0][2] == pytest.approx(0.03)
    assert worst == pytest.approx(0.01) and equal == 3 + 1


def test_too_few_tokens_before_the_divergences_fail():
    other = _out((1, {1: -0.51, 2: -1.0}), (4, {3: -0.72, 4: -0.71}), (9, {9: -0.1}))
    oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.1, 0.05, min_equal=4)
    with pytest.raises(AssertionError, match=r"only 4 tokens \(< 5\) before the divergences"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.1, 0.05, min_equal=5)


def test_an_exact_tie_taken_the_other_way_is_a_near_tie():
    tied = _out((1, {2: -0.5, 1: -0.5}), (3, {3: -0.7}), (5, {5: -0.1}))
    other = _out((2, {2: -0.5, 1: -0.5}), (3, {3: -0.7}), (5, {5: -0.1}))
    divs, _, equal = oracle_lib.near_tie_divergences(_run(tied), _run(other), 0.1, 0.05)
    assert divs == [(0, 0, 0.0)] and equal == 0


def test_a_gap_at_or_above_the_tie_tolerance_fails():
    other = _out((1, {1: -0.5}), (4, {3: -0.7, 4: -0.7}), (5, {5: -0.1}))
    with pytest.raises(AssertionError, match="not a near-tie"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.03, 0.05)


def test_the_third_token_of_a_three_way_near_tie_is_a_near_tie():
    # The restart oracle on the H200 (2026-12-04): plain's top three within 0.031.
    flat = _out((381, {381: -3.9617, 196: -3.9773, 201: -3.9929, 84: -4.1023}))
    took = _out((201, {201: -3.95, 381: -3.96}))
    divs, _, equal = oracle_lib.near_tie_divergences(_run(flat), _run(took), 0.1, 0.05)
    assert [(i, pos) for i, pos, _ in divs] == [(0, 0)] and equal == 0
    assert divs[0][2] == pytest.approx(0.0312)


def test_a_token_of_plains_top_k_far_below_its_best_fails():
    # 5 is in plain's top-k at position 1, but 0.2 below plain's best.
    other = _out((1, {1: -0.5}), (5, {5: -0.7}), (5, {5: -0.1}))
    with pytest.raises(AssertionError, match="took 5, 0.2000 below plain's best"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.1, 0.05)


def test_a_token_outside_plains_top_k_fails():
    other = _out((1, {1: -0.5}), (7, {7: -0.7}), (5, {5: -0.1}))
    with pytest.raises(AssertionError, match="took 7, not in plain's top-3"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.1, 0.05)


def test_a_divergence_where_plain_has_no_tie_fails():
    other = _out((2, {1: -0.5, 2: -1.0}), (3, {3: -0.7}), (5, {5: -0.1}))
    with pytest.raises(AssertionError, match="took 2, 0.5000 below plain's best"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.1, 0.05)


def test_logprobs_before_the_divergence_must_be_within_tol():
    other = _out((1, {1: -0.6, 2: -1.0}), (4, {3: -0.7, 4: -0.7}), (9, {9: -0.1}))
    with pytest.raises(AssertionError, match="before the divergences"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, other), 0.1, 0.05)


def test_mixed_length_prompts_have_the_issue_lengths():
    spec = oracle_lib.mixed_length_prompts()
    lengths = [len(p["prompt_token_ids"]) for p in spec["prompts"]]
    assert lengths == oracle_lib.MIXED_LENGTHS and min(lengths) == 1 and max(lengths) == 311
    assert spec["max_tokens"] == [32] * 12
    ids = [t for p in spec["prompts"] for t in p["prompt_token_ids"]]
    assert 5 <= min(ids) and max(ids) < 600 and len(set(ids)) > 400
    assert oracle_lib.mixed_length_prompts() == spec  # the same on every call


def test_windows_bound_the_logprob_comparison_and_never_the_tokens():
    # position 0 differs by 0.3 in logprob, position 2 by 0.02; tokens equal
    drift = _out((1, {1: -0.8, 2: -1.0}), (3, {3: -0.70, 4: -0.73}), (5, {5: -0.12}))
    windows = [range(1, 3), range(1, 3)]
    divs, worst, equal = oracle_lib.near_tie_divergences(PLAIN, _run(P, drift), 0.1, 0.05,
                                                         windows)  # fmt: skip
    assert divs == [] and worst == pytest.approx(0.02) and equal == 6
    with pytest.raises(AssertionError, match="max |logprob diff|"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, drift), 0.1, 0.05, [range(0, 1)] * 2)
    wrong = _out((1, {1: -0.5}), (3, {3: -0.7}), (6, {6: -0.1}))  # 2.9 below plain's best
    with pytest.raises(AssertionError, match="not a near-tie"):
        oracle_lib.near_tie_divergences(PLAIN, _run(P, wrong), 0.1, 0.05, [range(0, 0)] * 2)
