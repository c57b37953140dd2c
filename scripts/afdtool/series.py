"""Repository layout (overlay/, patches/, pin), the series file, and the input fingerprint."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import AfdError

if TYPE_CHECKING:
    from .targets import Target

# Bump when the way a tree is built changes, so old trees are rebuilt.
STATE_FORMAT = 1
OWNED_PATCH_RE = re.compile(r"^\d{4}-.*\.patch$")
MAIL_START_RE = re.compile(rb"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$", re.M)
SKIP_NAMES = {"__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}


@dataclass
class Series:
    path: Path
    header: list[str]  # leading comment/blank lines, kept by export
    entries: list[tuple[int, str]]  # (line number, patch file name)

    @property
    def names(self) -> list[str]:
        return [name for _, name in self.entries]


def read_series(repo: Target) -> Series:
    path = repo.series_file
    if not path.is_file():
        return Series(path=path, header=[], entries=[])
    header: list[str] = []
    entries: list[tuple[int, str]] = []
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            if not entries:
                header.append(raw)
            continue
        if " " in line or "/" in line:
            # quilt-style options (-p1) or sub-folders are not supported.
            raise AfdError(f"{path}:{lineno}: expected one patch file name, got {raw!r}")
        entries.append((lineno, line))
    while header and not header[-1].strip():
        header.pop()
    return Series(path=path, header=header, entries=entries)


def lint_series(repo: Target, series: Series) -> list[str]:
    """Problems between the series file and patches/ (empty list = fine)."""
    problems = []
    seen: dict[str, int] = {}
    for lineno, name in series.entries:
        if name in seen:
            problems.append(
                f"{series.path}:{lineno}: duplicate entry {name} (first on line {seen[name]})"
            )
            continue
        seen[name] = lineno
        f = repo.patches / name
        if not f.is_file():
            problems.append(f"{series.path}:{lineno}: {name} is listed but "
                            f"{repo.patches_label}/{name} is missing")
            continue
        data = f.read_bytes()
        mails = len(MAIL_START_RE.findall(data))
        if mails != 1:
            problems.append(
                f"{repo.patches_label}/{name}: expected exactly one `git format-patch` mail, "
                f"found {mails}"
            )
    if repo.patches.is_dir():
        for f in sorted(repo.patches.glob("*.patch")):
            if f.name not in seen:
                problems.append(f"{repo.patches_label}/{f.name} is not listed in "
                                f"{series.path.name}")
    return problems


def require_clean_series(repo: Target, series: Series) -> list[Path]:
    """Return the patch paths in order, or raise on missing/duplicate entries."""
    problems = [p for p in lint_series(repo, series) if "is not listed" not in p]
    if problems:
        raise AfdError(f"{repo.patches_label}/series is inconsistent:\n  "
                       + "\n  ".join(problems))
    return [repo.patches / name for name in series.names]


def overlay_files(overlay: Path) -> dict[str, Path]:
    """relative posix path -> file, for every file under overlay/ (caches skipped)."""
    result: dict[str, Path] = {}
    if not overlay.is_dir():
        return result
    for dirpath, dirnames, filenames in os.walk(overlay):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_NAMES)
        for fn in sorted(filenames):
            if fn.endswith((".pyc", ".pyo")):
                continue
            p = Path(dirpath) / fn
            if p.is_symlink() or not p.is_file():
                raise AfdError(f"{p}: overlay entries must be regular files (no links)")
            result[p.relative_to(overlay).as_posix()] = p
    return result


def inputs_fingerprint(repo: Target, source: str | None = None) -> str:
    """sha256 over everything that determines the built tree."""
    h = hashlib.sha256()

    def add(tag: str, data: bytes) -> None:
        h.update(tag.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)

    add("format", str(STATE_FORMAT).encode())
    add("version", repo.pin.version.encode())
    add("sdist", repo.pin.get("SDIST").encode())
    add("sdist-sha", repo.pin.get("SDIST_SHA256").encode())
    add("source", (source or "").encode())
    for rel, p in overlay_files(repo.overlay).items():
        add("overlay:" + rel, p.read_bytes())
        add("mode:" + rel, b"x" if os.access(p, os.X_OK) else b"-")
    if repo.series_file.is_file():
        add("series", repo.series_file.read_bytes())
        for name in read_series(repo).names:
            f = repo.patches / name
            add("patch:" + name, f.read_bytes() if f.is_file() else b"<missing>")
    return h.hexdigest()
