"""The one way to name an upstream target inside afdtool: a resolved `Target`.

The primary target is the pin `VLLM_VERSION` + `patches/` (tree `build/vllm`, venv `.venv`,
checkpoints `build/models`). Every further target X lives in `targets/X/VLLM_VERSION` +
`targets/X/patches/` (tree `build/vllm-X`, venv `.venv-X`, checkpoints `build/models-X`);
`overlay/` is shared by all targets.

`__main__` resolves the target once, from `--target X` (default: the primary pin; for the rebase
commands the newest carried target), and hands the same object to every command: its pin, its
patches folder and series, its tree, venv, models folder and its patch-set revision
(`afdtool revision`) all come from it. `--repo-root` (env AFD_REPO_ROOT) moves the repository;
`--tree` (env AFD_BUILD_TREE) replaces the tree only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import AfdError
from .pin import REPO_ROOT, Pin, PinError, load_pin
from .revision import patchset_revision

TARGETS_DIR = "targets"
PRIMARY_PIN = "VLLM_VERSION"


def vkey(v: str) -> tuple[int, ...]:
    """Sort key of a release number ("0.32.0" -> (0, 32, 0))."""
    return tuple(int(x) for x in v.split("."))


@dataclass(frozen=True)
class Target:
    """Everything that names one upstream target (built by `resolve`, never by hand)."""

    root: Path  # the repository (overlay/, patches/, targets/)
    pin: Pin
    primary: bool
    patches: Path  # patches/ or targets/X/patches
    overlay: Path  # overlay/ (a rebase exports into a scratch folder instead)
    tree: Path  # build/vllm or build/vllm-X (or --tree / AFD_BUILD_TREE)
    venv: Path  # .venv or .venv-X
    models: Path  # build/models or build/models-X

    @property
    def version(self) -> str:
        return self.pin.version

    @property
    def series_file(self) -> Path:
        return self.patches / "series"

    @property
    def patches_label(self) -> str:
        """The patches folder as the user names it (`patches` or `targets/X/patches`)."""
        try:
            return self.patches.relative_to(self.root).as_posix()
        except ValueError:
            return str(self.patches)

    @property
    def revision(self) -> str:
        """The patch-set revision of THIS target (its series, its patches, overlay/)."""
        return patchset_revision(self.patches, self.overlay)

    @property
    def gpu_deps_file(self) -> Path:
        """The wheels an offline bundle of this target carries beside vLLM: the target's own
        list (targets/X/gpu_host_deps.txt; a line whose torch differs from the GPU host's
        lists its torch there) or else the primary pin's (scripts/gpu_host_deps.txt)."""
        own = self.patches.parent / "gpu_host_deps.txt"
        if not self.primary and own.is_file():
            return own
        return self.root / "scripts" / "gpu_host_deps.txt"

    def with_overlay(self, overlay: Path) -> Target:
        return dataclasses.replace(self, overlay=overlay)

    def describe(self) -> str:
        kind = "primary pin" if self.primary else f"{TARGETS_DIR}/{self.version}"
        return f"vLLM {self.version} ({kind}, {self.patches_label})"


def repo_root(root: Path | str | None = None) -> Path:
    return Path(root or os.environ.get("AFD_REPO_ROOT") or REPO_ROOT).resolve()


def target_dir(root: Path | None, version: str) -> Path:
    return repo_root(root) / TARGETS_DIR / version


def _read_pin(path: Path) -> Pin:
    try:
        return load_pin(path)
    except PinError as exc:
        raise AfdError(str(exc)) from None


def primary_version(root: Path | None = None) -> str:
    return _read_pin(repo_root(root) / PRIMARY_PIN).version


def carried(root: Path | None = None) -> list[str]:
    """Versions the series is carried to (the primary pin and every targets/X), oldest first."""
    versions = {primary_version(root)}
    tdir = repo_root(root) / TARGETS_DIR
    if tdir.is_dir():
        versions |= {p.parent.name for p in tdir.glob(f"*/{PRIMARY_PIN}")}
    return sorted(versions, key=vkey)


def newest_carried(root: Path | None = None, below: str | None = None) -> str:
    """The newest carried target (older than `below` when given)."""
    versions = [v for v in carried(root) if below is None or vkey(v) < vkey(below)]
    if not versions:
        raise AfdError(f"no carried target older than {below}")
    return versions[-1]


def _tree(root: Path, version: str, primary: bool, tree: Path | str | None) -> Path:
    tree = tree or os.environ.get("AFD_BUILD_TREE")
    if tree:
        return Path(tree).absolute()
    return root / "build" / ("vllm" if primary else f"vllm-{version}")


def make_target(root: Path | None, pin: Pin, primary: bool, tree: Path | str | None = None,
                patches: Path | None = None) -> Target:
    root = repo_root(root)
    v = pin.version
    suffix = "" if primary else f"-{v}"
    return Target(
        root=root,
        pin=pin,
        primary=primary,
        patches=patches or (root / "patches" if primary else target_dir(root, v) / "patches"),
        overlay=root / "overlay",
        tree=_tree(root, v, primary, tree),
        venv=root / f".venv{suffix}",
        models=root / "build" / f"models{suffix}",
    )


def resolve(root: Path | str | None = None, version: str | None = None,
            tree: Path | str | None = None) -> Target:
    """The Target named by `version` (None: the primary pin)."""
    root = repo_root(root)
    primary_pin = _read_pin(root / PRIMARY_PIN)
    if not version or version == primary_pin.version:
        return make_target(root, primary_pin, True, tree)
    path = target_dir(root, version) / PRIMARY_PIN
    if not path.is_file():
        known = ", ".join(carried(root))
        raise AfdError(f"no target {version}: {path} does not exist (carried: {known}; create "
                       f"it with `make rebase VLLM_VERSION={version}`)")
    pin = _read_pin(path)
    if pin.version != version:
        raise AfdError(f"{pin.path}: VERSION={pin.version}, expected {version}")
    return make_target(root, pin, False, tree)


def planned(root: Path | None, values: dict[str, str], tree: Path | str | None = None) -> Target:
    """The Target a rebase creates: pin values in memory (targets/X/VLLM_VERSION not written)."""
    version = values["VERSION"]
    pin = Pin(path=target_dir(root, version) / PRIMARY_PIN, values=dict(values))
    return make_target(root, pin, False, tree)


def add_arguments(parser, tree: bool = True, from_newest: bool = False) -> None:
    """--repo-root, --target (and --tree): every command takes them (see __main__)."""
    default = ("the newest carried target (older than --to)" if from_newest
               else "the primary pin VLLM_VERSION")
    parser.add_argument(
        "--repo-root", type=Path, default=None,
        help="where overlay/, patches/, targets/ and VLLM_VERSION live (env AFD_REPO_ROOT)")
    parser.add_argument(
        "--target", dest="target_name", default=None, metavar="X",
        help="upstream target: X names targets/X/ (pin, patches, tree build/vllm-X, venv "
             f".venv-X, models build/models-X); default: {default}")
    if tree:
        parser.add_argument("--tree", type=Path, default=None,
                            help="build tree (env AFD_BUILD_TREE; default: the target's)")


def add_target_command_arguments(parser) -> None:
    parser.add_argument("--field", choices=("version", "pin", "patches", "tree", "venv", "models",
                                            "revision"),
                        help="print this field only")


def run_target_command(args) -> int:
    """`afdtool target [--target X] [--field F]`: the resolved target (the Makefile reads it)."""
    t: Target = args.target
    fields = {"version": t.version, "pin": str(t.pin.path), "patches": str(t.patches),
              "tree": str(t.tree), "venv": str(t.venv), "models": str(t.models),
              "revision": t.revision}
    if args.field:
        print(fields[args.field])
    else:
        for k, v in fields.items():
            print(f"{k}={v}")
    return 0


# __main__: the `target` command (this module's add_arguments is the common one).
COMMANDS = {"target": (add_target_command_arguments, run_target_command)}
