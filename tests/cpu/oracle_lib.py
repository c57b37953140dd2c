"""The correctness oracle's comparison, shared by the CPU tests."""

from __future__ import annotations


def assert_outputs_match(plain: dict, got: dict, max_tokens: list[int], tol: float) -> float:
    """AFD output ``got`` equals plain vLLM's ``plain`` (as written by afd_proc.py): greedy
    tokens identical, every plain top-k token in the AFD top-k with a logprob within
    ``tol``. Returns the largest logprob difference."""
    assert len(plain["outputs"]) == len(got["outputs"]) == len(max_tokens)
    worst = 0.0
    for i, (a, b) in enumerate(zip(plain["outputs"], got["outputs"])):
        assert a["token_ids"] == b["token_ids"], f"prompt {i}: tokens differ"
        assert len(a["token_ids"]) == max_tokens[i]
        for pos, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"])):
            for tok, lp in la.items():
                assert tok in lb, f"prompt {i} pos {pos}: token {tok} not in the AFD top-k"
                worst = max(worst, abs(lp - lb[tok]))
    assert worst <= tol, f"max |logprob diff| {worst} > {tol}"
    return worst
