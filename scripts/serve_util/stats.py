"""Statistics of the tests' and the benchmarks' results: logprob differences, the order
of rounds, the median run."""

from __future__ import annotations

from collections.abc import Callable


def max_logprob_diff(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    """Largest |logprob difference| over the top-k tokens of each position. A token in the
    top-k of one side only is scored with the smallest possible difference (its logprob
    minus the other side's k-th logprob, which bounds the unseen value from above): a tie
    swapped at rank k costs ~0, a real difference shows up. Different lengths give inf."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if not x and not y:
            continue
        if not x or not y:
            return float("inf")
        min_x, min_y = min(x.values()), min(y.values())
        for k in set(x) | set(y):
            if k in x and k in y:
                d = abs(x[k] - y[k])
            elif k in x:
                d = max(0.0, x[k] - min_y)
            else:
                d = max(0.0, y[k] - min_x)
            worst = max(worst, d)
    return worst


def rounds_of(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in the order benchmarks' --rounds runs them: the modes' order reversed
    every other round, so that no mode always runs first on a freshly warmed machine."""
    return [(rnd, mode) for rnd in range(rounds)
            for mode in (modes if rnd % 2 == 0 else modes[::-1])]  # fmt: skip


def median_run(runs: list[dict], value: Callable[[dict], float]) -> dict:
    """The benchmark run of median ``value`` (of an even number, the lower of the middle
    two): a run that was measured, not an average of two (benchmarks' --rounds)."""
    if not runs:
        raise ValueError("median_run: no runs")
    return sorted(runs, key=value)[(len(runs) - 1) // 2]
