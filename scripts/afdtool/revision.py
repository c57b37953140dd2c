"""Patch-set revision: a short content hash of patches/series, the listed patches and overlay/.

The revision names the AFD build in wheel versions (``0.26.0+afd.<rev>``, ``...<rev>.cpu``) and
in the handshake fingerprint, so two hosts built from different patch sets refuse to talk.
It depends only on file contents and relative paths (not on mtimes, git state or checkout path).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

REV_LEN = 10


def series_entries(series_text: str) -> list[str]:
    """Patch file names listed in a series file (blank lines and '#' comments skipped)."""
    names = []
    for raw in series_text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def _feed(h: hashlib._Hash, tag: str, name: str, data: bytes) -> None:
    # Length-prefixed framing so that no two different inputs hash the same stream.
    h.update(f"{tag}\0{name}\0{len(data)}\0".encode())
    h.update(data)


def patchset_digest(repo_root: Path | str) -> str:
    """Full sha256 hex digest of the patch set (series, listed patches, overlay/)."""
    root = Path(repo_root)
    h = hashlib.sha256()
    series = root / "patches" / "series"
    series_bytes = series.read_bytes() if series.is_file() else b""
    _feed(h, "series", "patches/series", series_bytes)
    for name in series_entries(series_bytes.decode()):
        patch = root / "patches" / name
        if not patch.is_file():
            raise FileNotFoundError(f"patches/series lists {name}, but {patch} does not exist")
        _feed(h, "patch", name, patch.read_bytes())
    overlay = root / "overlay"
    if overlay.is_dir():
        files = sorted(
            p.relative_to(overlay).as_posix()
            for p in overlay.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
        for rel in files:
            _feed(h, "overlay", rel, (overlay / rel).read_bytes())
    return h.hexdigest()


def patchset_revision(repo_root: Path | str) -> str:
    """Short (10 hex digits) patch-set revision."""
    return patchset_digest(repo_root)[:REV_LEN]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", default=None, help="repository root (default: this checkout)")


def run(args: argparse.Namespace) -> int:
    from afdtool.pin import REPO_ROOT

    print(patchset_revision(Path(args.repo) if args.repo else REPO_ROOT))
    return 0
