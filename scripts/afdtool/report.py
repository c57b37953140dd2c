"""`afdtool rebase-report`: try a target's series on every newer release -> markdown.

The series is that of `--target Y` (default: the newest carried target). Each release is tried in
a temporary tree (base = sdist, the overlay commit, then each patch alone) and its overlay drift
counted. Results are cached per release and series revision under `<cache>/report/`, so a second
run only redoes releases whose inputs changed (no sdist fetch for a cached release).
`--verify` (part of `make check`) fails when the committed report is stale: written for another
target than the newest carried one, or for another revision of its series.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from .apply import commit_overlay, init_tree, prepare_base
from .drift import Source, drift_findings, overlay_refs
from .errors import AfdError
from .gitutil import run_git
from .index import index_files, index_releases, log, release_base, release_pin
from .pin import cache_dir
from .rebase import abort_am, seed_old_objects, try_patch
from .revision import series_digest
from .series import overlay_files, read_series, require_clean_series
from .targets import Target, newest_carried, vkey

CACHE_FORMAT = 1
MARKER_RE = re.compile(r"<!-- afd-rebase-report target=(\S+) series=([0-9a-f]+) -->")
SERIES_REV_LEN = 12


def try_series(src: Target, patches: list[Path], old_pristine: Path, pristine: Path) -> list[str]:
    """Cells for one release, in a temporary tree (never build/ or the pin)."""
    tmp = Path(tempfile.mkdtemp(prefix="afd-report-"))
    try:
        tree = tmp / "vllm"
        init_tree(tree, pristine)
        seed_old_objects(tree, old_pristine, patches)
        try:
            commit_overlay(tree, src)
        except AfdError:
            return ["overlay-conflict"] * len(patches)
        cells, after = [], False
        for p in patches:
            r = try_patch(tree, p)
            if r in ("conflict", "empty"):
                if run_git(tree, "am", "--skip", check=False).returncode:
                    abort_am(tree)
                abort_am(tree)
            cells.append(r + (" (after-conflict)" if after else ""))
            after = after or r == "conflict"
        return cells
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def series_revision(target: Target) -> str:
    """The revision of a target's series (series file + listed patches; not overlay/)."""
    return series_digest(target.patches)[:SERIES_REV_LEN]


def _digest(doc) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]


class ReportCache:
    """Per release: the cells (key: release sdist, base, series, overlay file names) and the drift
    findings (key: release sdist, base, the overlay's vllm references)."""

    def __init__(self, target: Target, directory: Path | None = None):
        self.dir = directory or cache_dir() / "report"
        base = [target.pin.get("SDIST_SHA256"), CACHE_FORMAT]
        self.cells_key = _digest(base + [series_digest(target.patches),
                                         sorted(overlay_files(target.overlay))])
        refs, own = overlay_refs(target.overlay)
        self.drift_key = _digest(base + [[asdict(r) for r in refs], sorted(own)])

    def _path(self, kind: str, release: str, sdist_sha: str) -> Path:
        key = self.cells_key if kind == "cells" else self.drift_key
        return self.dir / release / f"{kind}-{_digest([key, sdist_sha])}.json"

    def get(self, kind: str, release: str, sdist_sha: str):
        p = self._path(kind, release, sdist_sha)
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    def put(self, kind: str, release: str, sdist_sha: str, value) -> None:
        p = self._path(kind, release, sdist_sha)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(p)


class Bases:
    """The pristine trees, made only when a release is not cached."""

    def __init__(self, src: Target):
        self.src = src
        self._old: Path | None = None
        self._old_source: Source | None = None

    @property
    def old(self) -> Path:
        if self._old is None:
            self._old, _ = prepare_base(self.src, None)
        return self._old

    @property
    def old_source(self) -> Source:
        if self._old_source is None:
            self._old_source = Source(self.old)
        return self._old_source


def one_release(src, patches, cache: ReportCache, bases: Bases, v: str, values: dict):
    """(cells, drift findings, timing, cached) of release v."""
    sha = values["SDIST_SHA256"]
    cells, drift = cache.get("cells", v, sha), cache.get("drift", v, sha)
    if cells is not None and drift is not None:
        return cells, [tuple(f) for f in drift], (0.0, 0.0, 0.0), True
    t0 = time.monotonic()
    pristine, _ = release_base(values)
    t1 = time.monotonic()
    if cells is None:
        cells = try_series(src, patches, bases.old, pristine)
        cache.put("cells", v, sha, cells)
    t2 = time.monotonic()
    if drift is None:
        drift = drift_findings(bases.old_source, Source(pristine), src.overlay)
        cache.put("drift", v, sha, drift)
    t3 = time.monotonic()
    return cells, [tuple(f) for f in drift], (t1 - t0, t2 - t1, t3 - t2), False


def releases_to_do(src: Target, releases: list[str] | None, available: list[str]) -> list[str]:
    if releases:
        missing = [v for v in releases if v not in available]
        if missing:
            raise AfdError(f"not on the index (no sdist): {', '.join(missing)}")
        return sorted(releases, key=vkey)
    return [v for v in available if vkey(v) > vkey(src.version)]


def rebase_report(src: Target, releases: list[str] | None, out: Path | None,
                  cache_directory: Path | None = None) -> int:
    patches = require_clean_series(src, read_series(src))
    files = index_files("vllm")
    todo = releases_to_do(src, releases, index_releases(files))
    if not todo:
        print(f"no release newer than {src.version} on the index")
    cache, bases = ReportCache(src, cache_directory), Bases(src)
    columns, drifts, timing, cached = {}, {}, {}, []
    for i, v in enumerate(todo, 1):
        values = release_pin(v, files=files, need_wheels=False)
        columns[v], drifts[v], timing[v], hit = one_release(src, patches, cache, bases, v, values)
        if hit:
            cached.append(v)
        log(f"[{i}/{len(todo)}] {v}: " + ", ".join(columns[v]) + f"; drift {len(drifts[v])}; "
            + ("cached" if hit else f"{sum(timing[v]):.1f}s"))
    text = report_markdown(src, patches, todo, columns, drifts, timing, cached)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out} ({len(cached)} of {len(todo)} release(s) from the cache)")
    else:
        print(text)
    return 0


def report_markdown(src: Target, patches, todo, columns, drifts, timing, cached=()) -> str:
    lines = [
        "# Upstream status of the AFD patch series",
        "",
        f"<!-- afd-rebase-report target={src.version} series={series_revision(src)} -->",
        "",
        f"Generated by `make rebase-report` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f" for the series of target {src.version} ({src.patches_label}, {len(patches)} patches,"
        f" series revision {series_revision(src)}), against every newer final release with an"
        " sdist on the package index. Each release is tried in a temporary tree (base = sdist,"
        " the overlay commit, then each patch alone). Regenerate with `make rebase-report`"
        " (incremental: unchanged releases come from the cache); `make check` fails when this"
        " file was made for another series revision or another target than the newest carried"
        " one. See docs/rebasing.md.",
        "",
        "Cells: `clean` applies exactly; `offset` applies with line offsets only; `three-way` needs"
        " `git am -3` (merges cleanly); `conflict` needs a manual resolution; `empty` upstream"
        " already contains the change; `(after-conflict)` the result with the conflicting patch"
        " skipped, so it may differ once that conflict is resolved.",
        "",
        "| patch | " + " | ".join(todo) + " |",
        "|---|" + "---|" * len(todo),
    ]
    for i, p in enumerate(patches):
        lines.append(f"| {p.name} | " + " | ".join(columns[v][i] for v in todo) + " |")
    lines.append("| **overlay drift findings** | "
                 + " | ".join(str(len(drifts[v])) for v in todo) + " |")
    lines += ["", "## Overlay drift", "",
              "`afdtool drift --to X`: static AST check of the overlay's `vllm` imports, attribute"
              " uses of imported vllm modules and keyword calls against release X (a module"
              f" deleted, a name that resolves in {src.version} but not in X, or a parameter list"
              " changed other than by added optional parameters).", ""]
    for v in todo:
        lines.append(f"### {v}: {len(drifts[v])} finding(s)")
        lines.append("")
        for name, where, status in drifts[v][:40]:
            lines.append(f"- `{name}` ({where}): {status}")
        if len(drifts[v]) > 40:
            lines.append(f"- ... {len(drifts[v]) - 40} more (`make drift VLLM_VERSION={v}`)")
        if drifts[v]:
            lines.append("")
    lines += ["## Timing per release", "",
              "| release | fetch + unpack (s) | series (s) | drift (s) | total (s) |",
              "|---|---|---|---|---|"]
    for v in todo:
        if v in cached:
            lines.append(f"| {v} | cached | cached | cached | cached |")
            continue
        a, b, c = timing[v]
        lines.append(f"| {v} | {a:.1f} | {b:.1f} | {c:.1f} | {a + b + c:.1f} |")
    lines.append("")
    lines.append("Fetch time is near zero when the sdist is already in the download cache "
                 "(first download: about 40 MB per release); `cached`: the result of an earlier "
                 "run for the same release and inputs.")
    return "\n".join(lines) + "\n"


def stale_problems(doc: Path, root: Path) -> list[str]:
    """Why `doc` (docs/upstream-status.md) is not current ([] when it is)."""
    from .targets import resolve

    if not doc.is_file():
        return [f"{doc} is missing: run `make rebase-report`"]
    m = MARKER_RE.search(doc.read_text())
    if not m:
        return [f"{doc} has no afd-rebase-report marker (made by an older afdtool): run "
                "`make rebase-report`"]
    target, rev = m.groups()
    newest = newest_carried(root)
    if target != newest:
        return [f"{doc} reports the series of {target}, but the newest carried target is "
                f"{newest}: run `make rebase-report`"]
    now = series_revision(resolve(root, target))
    if now != rev:
        return [f"{doc} was made for series revision {rev} of {target}; it is {now} now (a "
                "patch or the series changed): run `make rebase-report` and commit the file"]
    return []


def add_arguments(p) -> None:
    p.add_argument("--releases", nargs="*", help="releases (default: all newer than the target)")
    p.add_argument("--out", type=Path, help="markdown file (default: stdout)")
    p.add_argument("--verify", action="store_true",
                   help="no network: exit 1 when --out is stale (another target or series "
                   "revision than now)")


def run(args) -> int:
    if args.verify:
        if not args.out:
            raise AfdError("--verify needs --out FILE")
        problems = stale_problems(args.out, args.target.root)
        for p in problems:
            print(f"FAIL  {p}")
        if not problems:
            print(f"PASS  {args.out} is current (series of {newest_carried(args.target.root)})")
        return 1 if problems else 0
    src = args.target
    how = "the newest carried target" if args.target_default else "--target"
    print(f"rebase-report: the series of {src.describe()} ({how})")
    releases = [r for a in (args.releases or []) for r in a.replace(",", " ").split()]
    return rebase_report(src, releases or None, args.out)
