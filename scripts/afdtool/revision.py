"""Patch-set revision of a target: a short content hash of its series, the listed patches and
overlay/.

The revision names the AFD build in wheel versions (``0.32.0+afd.<rev>``, ``...<rev>.cpu``) and
in the handshake fingerprint, so two hosts built from different patch sets refuse to talk. Each
target hashes its OWN series (`patches/` for the primary pin, `targets/X/patches/` for X).
It depends only on file contents and relative paths (not on mtimes, git state or checkout path).
`afdtool revision [--target X]` prints it.
"""

from __future__ import annotations

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


def _feed(h, tag: str, name: str, data: bytes) -> None:
    # Length-prefixed framing so that no two different inputs hash the same stream.
    h.update(f"{tag}\0{name}\0{len(data)}\0".encode())
    h.update(data)


def series_digest(patches: Path | str) -> str:
    """sha256 hex of a patches folder's series file and the patches it lists (not overlay/)."""
    h = hashlib.sha256()
    feed_series(h, Path(patches))
    return h.hexdigest()


def feed_series(h, patches: Path) -> None:
    series = patches / "series"
    series_bytes = series.read_bytes() if series.is_file() else b""
    _feed(h, "series", "patches/series", series_bytes)
    for name in series_entries(series_bytes.decode()):
        patch = patches / name
        if not patch.is_file():
            raise FileNotFoundError(f"{series} lists {name}, but {patch} does not exist")
        _feed(h, "patch", name, patch.read_bytes())


def patchset_digest(patches: Path | str, overlay: Path | str) -> str:
    """Full sha256 hex digest of a patch set (series, listed patches, overlay/)."""
    h = hashlib.sha256()
    feed_series(h, Path(patches))
    overlay = Path(overlay)
    if overlay.is_dir():
        files = sorted(
            p.relative_to(overlay).as_posix()
            for p in overlay.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
        for rel in files:
            _feed(h, "overlay", rel, (overlay / rel).read_bytes())
    return h.hexdigest()


def patchset_revision(patches: Path | str, overlay: Path | str) -> str:
    """Short (10 hex digits) patch-set revision."""
    return patchset_digest(patches, overlay)[:REV_LEN]


def add_arguments(parser) -> None:
    pass  # --target / --repo-root come from __main__


def run(args) -> int:
    print(args.target.revision)
    return 0
