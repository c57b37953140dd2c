"""Fixtures of the GPU tests: the CPU tests' harness (tests/cpu/harness.py) starts their
engines too."""

from harness import procs  # noqa: F401  (fixture: the afd_proc.py engines a test starts)
