"""Fixtures of the unit tests; defined in pipeline_lib.py so that test modules can import
its helpers by a unique module name (two conftest.py files would shadow each other)."""

from pipeline_lib import afd, warm  # noqa: F401  (pytest fixtures)
