"""Shared by every test directory.

* vLLM imports torch.utils.cpp_extension, which imports setuptools, whose distutils shim
  asserts when the standard library's distutils was imported earlier in the process (some
  tooling tests import it through pip/wheel). Loading setuptools first keeps in-process vLLM
  imports working in one long pytest run.
* In this pytest process the AFD modules (``vllm.afd``, ``vllm.distributed.afd``,
  ``vllm.config.afd``) are imported from ``overlay/`` as it is in the tree, not from the custom
  wheel installed in the venv, which may be older than the tree (see :mod:`overlay_import`).
  The processes that the CPU tests start run the installed wheel (``make test`` rebuilds it
  first).
* Per-test time limits: see :mod:`timeouts`.
"""

import overlay_import
import timeouts

try:
    import setuptools  # noqa: F401
except ImportError:  # the tooling tests also run on a bare Python
    pass

overlay_import.install()


def pytest_collection_modifyitems(config, items):
    timeouts.apply(config, items)
