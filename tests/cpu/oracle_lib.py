"""The correctness oracle's prompts and comparison, shared by the CPU and GPU tests."""

from __future__ import annotations

import json
from pathlib import Path

# The CPU oracle's tolerance on the top-k logprobs of every generated position (fp32
# engines; the FFN's sums split across processes change the last bits). The GPU tests
# state their own (bf16).
LOGPROB_TOL = 1e-4

# The oracle's prompts: different lengths with different max_tokens, so that with
# max_num_seqs=4 the scheduler mixes prefills with decodes (continuous batching).
PROMPTS = {
    "prompts": [
        "Hello, my name is",
        "The capital of France is",
        "def add(a, b):",
        "One two three",
        "A long time ago in a galaxy far, far away, there was a small robot who",
        "Q: What is two plus two?\nA:",
        "import numpy as np\n\nx = np.arange(10)\n",
        "The quick brown fox",
        "In the beginning",
        "Once upon a time, in a land of dragons and wizards and tall mountains,",
    ],
    "max_tokens": [24, 8, 16, 30, 12, 20, 10, 28, 6, 18],
}


def write_prompts(directory: Path, spec: dict = PROMPTS) -> Path:
    """``directory``/prompts.json for ``afd_proc.py --prompts`` (``PROMPTS`` by default)."""
    path = Path(directory) / "prompts.json"
    path.write_text(json.dumps(spec))
    return path


def assert_outputs_match(plain: dict, got: dict, max_tokens: list[int], tol: float) -> float:
    """AFD output ``got`` equals plain vLLM's ``plain`` (as written by afd_proc.py): greedy
    tokens identical, every plain top-k token in the AFD top-k with a logprob within
    ``tol``. Returns the largest logprob difference."""
    assert len(plain["outputs"]) == len(got["outputs"]) == len(max_tokens)
    worst = 0.0
    for i, (a, b) in enumerate(zip(plain["outputs"], got["outputs"])):
        assert a["token_ids"] == b["token_ids"], f"prompt {i}: tokens differ"
        assert len(a["token_ids"]) == max_tokens[i]
        assert len(a["logprobs"]) == len(b["logprobs"]) == max_tokens[i], (
            f"prompt {i}: logprobs for {len(a['logprobs'])} (plain) and "
            f"{len(b['logprobs'])} (AFD) of {max_tokens[i]} tokens")
        for pos, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"])):
            for tok, lp in la.items():
                assert tok in lb, f"prompt {i} pos {pos}: token {tok} not in the AFD top-k"
                worst = max(worst, abs(lp - lb[tok]))
    assert worst <= tol, f"max |logprob diff| {worst} > {tol}"
    return worst


# A mixed-length workload: 12 prompts of 1 to 311 tokens generated at once (prefill chunks
# beside decodes, a different mix every step), 32 greedy tokens each.
MIXED_LENGTHS = [1, 2, 5, 11, 23, 40, 64, 97, 131, 180, 242, 311]


def mixed_length_prompts(vocab: int = 600, first: int = 5, max_tokens: int = 32) -> dict:
    """``MIXED_LENGTHS`` prompts as token ids (a fixed sequence in [first, vocab), no
    special tokens), so that their lengths are exact on any tokenizer of that size."""
    x, prompts = 20261204, []
    for n in MIXED_LENGTHS:
        ids = []
        for _ in range(n):
            x = (x * 1103515245 + 12345) % (1 << 31)
            ids.append(first + x % (vocab - first))
        prompts.append({"prompt_token_ids": ids})
    return {"prompts": prompts, "max_tokens": [max_tokens] * len(MIXED_LENGTHS)}


def near_tie_divergences(plain: dict, got: dict, tie_tol: float, tol: float,
                         windows: list[range] | None = None, min_equal: int = 0):
    """Greedy tokens of ``got`` equal plain vLLM's, or else each prompt's first divergence
    is a near-tie in plain's own distribution: ``got`` took a token of plain's top-k whose
    logprob is less than ``tie_tol`` below plain's best (a bf16 ulp elsewhere could have
    made plain take it; with flat distributions three or more tokens can be that close).
    Up to there, every top-k token present in both has logprobs within ``tol``; after it
    the contexts differ and the prompt's comparison stops. Returns (divergences as
    (prompt, position, gap of the taken token to plain's best), largest logprob
    difference, tokens equal before the first divergences). ``windows`` (per prompt, the
    positions whose logprobs are compared; the largest difference of every position is
    printed): the tokens are compared everywhere all the same. ``min_equal``: the fewest
    tokens that must come before the divergences (a divergence ends its prompt's
    comparison, so early ones would leave little compared)."""
    assert len(plain["outputs"]) == len(got["outputs"])
    divergences, worst, equal, anywhere = [], 0.0, 0, 0.0
    for i, (a, b) in enumerate(zip(plain["outputs"], got["outputs"])):
        assert len(a["token_ids"]) == len(b["token_ids"]), f"prompt {i}: lengths differ"
        for pos, (ta, tb) in enumerate(zip(a["token_ids"], b["token_ids"])):
            la, lb = a["logprobs"][pos], b["logprobs"][pos]
            if ta != tb:
                # plain's own token first among equal logprobs (a bf16 tie is exact)
                ranked = sorted(la.items(), key=lambda kv: (-kv[1], kv[0] != str(ta)))
                assert ranked[0][0] == str(ta), \
                    f"prompt {i} pos {pos}: plain's token {ta} is not its top-1 {ranked[:2]}"
                assert str(tb) in la, (
                    f"prompt {i} pos {pos}: took {tb}, not in plain's top-{len(la)} {ranked}")
                gap = ranked[0][1] - la[str(tb)]
                assert gap < tie_tol, (
                    f"prompt {i} pos {pos}: took {tb}, {gap:.4f} below plain's best "
                    f"(>= {tie_tol}): not a near-tie (plain's top-k {ranked})")
                divergences.append((i, pos, gap))
                break
            equal += 1
            diff = max((abs(lp - lb[tok]) for tok, lp in la.items() if tok in lb), default=0.0)
            anywhere = max(anywhere, diff)
            if windows is None or pos in windows[i]:
                worst = max(worst, diff)
    if windows is not None:
        print(f"max |logprob diff| before the divergences: {worst:.4f} in the windows, "
              f"{anywhere:.4f} anywhere")
    assert worst <= tol, f"max |logprob diff| before the divergences {worst} > {tol}"
    assert equal >= min_equal, (
        f"only {equal} tokens (< {min_equal}) before the divergences {divergences}")
    return divergences, worst, equal
