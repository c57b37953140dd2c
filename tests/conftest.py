"""Shared by every test directory.

vLLM imports torch.utils.cpp_extension, which imports setuptools, whose distutils shim asserts
when the standard library's distutils was imported earlier in the process (some tooling tests
import it through pip/wheel). Loading setuptools first keeps in-process vLLM imports working
in one long pytest run.
"""

try:
    import setuptools  # noqa: F401
except ImportError:  # the tooling tests also run on a bare Python
    pass
