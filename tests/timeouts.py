"""Per-test time limits (pytest-timeout), so that a hung test fails instead of stalling CI.

pyproject.toml sets ``timeout = 600`` s: the limit of a test that starts vLLM engines. A
test under ``tests/unit/`` gets :data:`UNIT_TIMEOUT_S` instead, unless it is marked as a
long one (``slow``, ``cpu_e2e``, ``gpu``) or carries its own ``@pytest.mark.timeout``.
A limit given for the run (``--timeout N`` or ``PYTEST_TIMEOUT``; 0 turns limits off, e.g.
under a debugger) applies to every test: this module then adds nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

UNIT_DIR = Path(__file__).resolve().parent / "unit"
# The slowest unit test not marked slow took 7 s here (pytest --durations, 2 busy cores).
UNIT_TIMEOUT_S = 120.0
LONG_MARKERS = frozenset({"slow", "cpu_e2e", "gpu"})


def unit_timeout(path: Path, markers: Iterable[str]) -> float | None:
    """The limit this module gives the test in ``path`` with these marker names:
    UNIT_TIMEOUT_S under tests/unit/ for a test not marked long and without a timeout
    marker of its own; None (pyproject's limit, or the test's own) otherwise."""
    names = set(markers)
    if "timeout" in names or names & LONG_MARKERS:
        return None
    if UNIT_DIR not in Path(path).resolve().parents:
        return None
    return UNIT_TIMEOUT_S


def limit_given_for_the_run(config: pytest.Config) -> bool:
    return config.getoption("timeout", None) is not None or "PYTEST_TIMEOUT" in os.environ


def apply(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each collected test that :func:`unit_timeout` gives a limit (nothing without
    pytest-timeout, or with a limit given for the run)."""
    if not config.pluginmanager.hasplugin("timeout") or limit_given_for_the_run(config):
        return
    for item in items:
        limit = unit_timeout(item.path, (m.name for m in item.iter_markers()))
        if limit is not None:
            item.add_marker(pytest.mark.timeout(limit))
