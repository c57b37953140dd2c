"""Import the AFD modules from the tree's ``overlay/`` instead of the installed wheel.

The overlay adds whole packages and one module to vLLM (``vllm.afd``,
``vllm.distributed.afd``, ``vllm.config.afd``). A meta-path finder placed first answers
for exactly those names with the files under ``overlay/``; their parent packages
(``vllm``, ``vllm.distributed``, ``vllm.config``) and everything else still come from
the installed vLLM. So the unit tests check the code as edited, without a wheel rebuild,
and a test of an AFD module fails (ImportError) rather than skips when vLLM or torch is
missing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[1] / "overlay"
# Top-level names the overlay owns: each and everything below it is loaded from OVERLAY.
ROOTS = ("vllm.afd", "vllm.distributed.afd", "vllm.config.afd")


def overlay_path(fullname: str) -> tuple[Path, bool] | None:
    """(file, is_package) under OVERLAY for a module the overlay owns, else None."""
    if not any(fullname == r or fullname.startswith(r + ".") for r in ROOTS):
        return None
    base = OVERLAY.joinpath(*fullname.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    return None


class OverlayFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        found = overlay_path(fullname)
        if found is None:
            return None
        file, is_package = found
        return importlib.util.spec_from_file_location(
            fullname,
            file,
            submodule_search_locations=[str(file.parent)] if is_package else None,
        )


def install() -> None:
    """Put the finder first (once); AFD modules imported earlier are dropped so that
    the next import loads them from the overlay."""
    if not any(isinstance(f, OverlayFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OverlayFinder())
    for name in [n for n in sys.modules if overlay_path(n) is not None]:
        del sys.modules[name]


def child_env() -> dict[str, str]:
    """The environment of a Python child that imports the AFD modules from the tree
    (``import overlay_import; overlay_import.install()`` first), as this process does."""
    tests_dir = Path(__file__).resolve().parent
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir), *sys.path])}
