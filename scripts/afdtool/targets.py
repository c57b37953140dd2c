"""Second (and further) upstream targets: `targets/<X>/VLLM_VERSION` + `targets/<X>/patches/`.

The primary pin stays `VLLM_VERSION` + `patches/` (default tree `build/vllm`). A target X other
than the primary version switches the pin file to `targets/X/VLLM_VERSION`, the patch folder to
`targets/X/patches/` and the default tree to `build/vllm-X`; `overlay/` is shared by all targets.
Chosen with `--target X` (apply, check, export) or env `AFD_TARGET`; `--tree` and
`AFD_BUILD_TREE` still win over the default tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import AfdError
from .pin import REPO_ROOT, Pin, PinError, load_pin
from .series import Repo, default_tree, load_repo

TARGETS_DIR = "targets"


@dataclass
class TargetRepo(Repo):
    """A Repo whose patches/ folder is targets/X/patches (pin: targets/X/VLLM_VERSION)."""

    patches_dir: Path | None = None
    overlay_dir: Path | None = None  # set only by rebase (export into a scratch folder)

    @property
    def overlay(self) -> Path:
        return self.overlay_dir if self.overlay_dir is not None else self.root / "overlay"

    @property
    def patches(self) -> Path:
        return self.patches_dir if self.patches_dir is not None else self.root / "patches"

    @property
    def target(self) -> str:
        return self.pin.version


def add_target_argument(parser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        metavar="X",
        help="upstream target: the primary pin (default) or X with targets/X/VLLM_VERSION and "
        "targets/X/patches/ (env AFD_TARGET); default tree build/vllm-X",
    )


def _root(repo_root: Path | None) -> Path:
    return Path(repo_root or os.environ.get("AFD_REPO_ROOT") or REPO_ROOT).resolve()


def target_dir(repo_root: Path | None, version: str) -> Path:
    return _root(repo_root) / TARGETS_DIR / version


def primary_version(repo_root: Path | None = None) -> str | None:
    root = _root(repo_root)
    try:
        return load_pin(Path(os.environ.get("AFD_PIN_FILE") or root / "VLLM_VERSION")).version
    except PinError:
        return None


def is_primary(repo_root: Path | None, target: str | None) -> bool:
    return not target or target == primary_version(repo_root)


def target_repo(repo_root: Path | None, version: str, pin: Pin | None = None) -> TargetRepo:
    """The Repo of target `version`; pin may be given in memory (the file need not exist)."""
    d = target_dir(repo_root, version)
    if pin is None:
        try:
            pin = load_pin(d / "VLLM_VERSION")
        except PinError as exc:
            raise AfdError(f"{exc} (target {version}: create it with `make rebase "
                           f"VLLM_VERSION={version}`)") from None
        if pin.version != version:
            raise AfdError(f"{pin.path}: VERSION={pin.version}, expected {version}")
    return TargetRepo(root=_root(repo_root), pin=pin, patches_dir=d / "patches")


def load(repo_root: Path | None, target: str | None = None) -> Repo:
    """`load_repo` for the primary target (unchanged behaviour), else the target's Repo."""
    target = target or os.environ.get("AFD_TARGET") or None
    if is_primary(repo_root, target):
        return load_repo(repo_root)
    return target_repo(repo_root, target)


def tree(repo: Repo, tree_arg: Path | None = None) -> Path:
    """`default_tree` for the primary target, else --tree / AFD_BUILD_TREE / build/vllm-X."""
    if not isinstance(repo, TargetRepo):
        return default_tree(repo, tree_arg)
    return Path(tree_arg or os.environ.get("AFD_BUILD_TREE")
                or repo.root / "build" / f"vllm-{repo.pin.version}").absolute()
