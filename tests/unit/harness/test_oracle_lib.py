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


def test_exact_refuses_missing_logprobs():
    # afd_proc.py writes [] when a run returned no logprobs: nothing would be compared
    other = _run({"token_ids": [1, 3, 5], "logprobs": []})
    with pytest.raises(AssertionError, match="logprobs for 3 .plain. and 0 .AFD. of 3"):
        oracle_lib.assert_outputs_match(PLAIN, other, [3], 0.1)
