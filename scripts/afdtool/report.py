"""`afdtool rebase-report`: try the carried series on the upstream releases -> markdown.

Default: every release newer than the oldest carried line (the primary pin) is tried with the
series `make rebase VLLM_VERSION=R` would start from, the newest carried target older than R
(0.27.0 ... 0.32.0 from 0.26.0, 0.33.0 from 0.32.0, ..., and every release newer than the newest
target from the newest); a carried release so shows what porting it cost. `--target Y` tries Y's
series alone on every release newer than Y. Each release is tried in a temporary tree (base =
sdist, the overlay commit, then each patch alone) and its overlay drift counted. Results are
cached per release and series revision under `<cache>/report/`, so a second run only redoes
releases whose inputs changed (no sdist fetch for a cached release). `--verify` (part of `make
check`) fails when the committed report is stale: not made by the default run for the newest
carried target, or made for another revision of one of the carried series.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
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
from .targets import Target, carried, newest_carried, resolve, vkey

CACHE_FORMAT = 2  # 2: three-way merges without rename detection (rebase.AM_3WAY)
MARKER_RE = re.compile(
    r"<!-- afd-rebase-report target=(\S+) series=([0-9a-f]+)(?: from=(\S+))? -->")
SERIES_REV_LEN = 12
# From this line on, docs/upstream-status.md is written by hand (a pointer to docs/status.md);
# a new report keeps it.
KEEP_MARKER = "<!-- written by hand from here on: make rebase-report keeps it -->"


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


def report_revision(starts: list[Target]) -> str:
    """The revision of a report: its starting series (one, or every carried one)."""
    if len(starts) == 1:
        return series_revision(starts[0])
    doc = [[t.version, series_revision(t)] for t in starts]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:SERIES_REV_LEN]


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


def plan(src: Target, chain: bool, releases: list[str] | None,
         available: list[str]) -> list[tuple[Target, list[str]]]:
    """(starting target, its releases), oldest first. `chain`: each release from the newest
    carried target older than it (the default); else `src` for all."""
    if not chain:
        return [(src, releases_to_do(src, releases, available))]
    lines = carried(src.root)
    todo = releases_to_do(resolve(src.root, lines[0]), releases, available)
    groups: dict[str, list[str]] = {} if releases else {lines[-1]: []}
    for v in todo:
        groups.setdefault(newest_carried(src.root, below=v), []).append(v)
    return [(resolve(src.root, v), groups[v]) for v in sorted(groups, key=vkey)]


def kept_part(out: Path) -> str:
    """The hand-written end of `out` (from KEEP_MARKER on), "" when it has none."""
    old = out.read_text() if out.is_file() else ""
    i = old.find(KEEP_MARKER)
    return "\n" + old[i:] if i >= 0 else ""


@dataclass
class Group:
    """One starting series and its releases' results."""

    src: Target
    patches: list[Path]
    todo: list[str]
    columns: dict = field(default_factory=dict)
    drifts: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    cached: list = field(default_factory=list)


def run_group(src: Target, todo: list[str], files: dict, cache_directory: Path | None) -> Group:
    g = Group(src, require_clean_series(src, read_series(src)), todo)
    cache, bases = ReportCache(src, cache_directory), Bases(src)
    for v in todo:
        values = release_pin(v, files=files, need_wheels=False)
        g.columns[v], g.drifts[v], g.timing[v], hit = one_release(src, g.patches, cache, bases,
                                                                  v, values)
        if hit:
            g.cached.append(v)
        log(f"[{src.version} -> {v}]: " + ", ".join(g.columns[v])
            + f"; drift {len(g.drifts[v])}; "
            + ("cached" if hit else f"{sum(g.timing[v]):.1f}s"))
    return g


def rebase_report(src: Target, releases: list[str] | None, out: Path | None,
                  cache_directory: Path | None = None, chain: bool = False) -> int:
    files = index_files("vllm")
    groups = [run_group(t, todo, files, cache_directory)
              for t, todo in plan(src, chain, releases, index_releases(files))]
    if not any(g.todo for g in groups):
        print(f"no release newer than {src.version} on the index")
    text = report_markdown(groups, chain)
    total = sum(len(g.todo) for g in groups)
    hits = sum(len(g.cached) for g in groups)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        text += kept_part(out)
        out.write_text(text)
        print(f"wrote {out} ({hits} of {total} release(s) from the cache)")
    else:
        print(text)
    return 0


CELLS_TEXT = (
    "Cells: `clean` applies exactly; `offset` applies with line offsets only; `three-way` needs"
    " `git am -3` (merges cleanly); `conflict` needs a manual resolution; `empty` upstream"
    " already contains the change; `(after-conflict)` the result with the conflicting patch"
    " skipped, so it may differ once that conflict is resolved."
)


def report_markdown(groups: list[Group], chain: bool = False) -> str:
    starts = [g.src for g in groups]
    newest = starts[-1]
    rev = report_revision(starts)
    froms = ",".join(t.version for t in starts)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if chain:
        what = (f"for every final release with an sdist on the package index newer than"
                f" {starts[0].version}, each tried with the series `make rebase VLLM_VERSION=R`"
                " starts from: the newest carried target older than it (for a carried release,"
                " what porting it cost before any hand resolution)")
    else:
        what = (f"for the series of target {newest.version} alone (`--target`), against every"
                " newer final release with an sdist on the package index")
    lines = [
        "# Upstream status of the AFD patch series",
        "",
        f"<!-- afd-rebase-report target={newest.version} series={rev} from={froms} -->",
        "",
        f"Generated by `make rebase-report` on {when} {what}. Each release is tried in a"
        " temporary tree (base = sdist, the overlay commit, then each patch alone)."
        " Regenerate with `make rebase-report` (incremental: unchanged releases come from the"
        " cache); `make check` fails when this file was not made that way for the newest carried"
        f" target or when one of its series changed (report revision {rev}). See"
        " docs/rebasing.md.",
        "",
        CELLS_TEXT,
        "",
    ]
    for g in groups:
        lines += group_table(g)
    lines += drift_section(groups) + timing_section(groups)
    return "\n".join(lines) + "\n"


def group_table(g: Group) -> list[str]:
    head = (f"## From {g.src.version} ({g.src.patches_label}, {len(g.patches)} patches, series"
            f" revision {series_revision(g.src)})")
    if not g.todo:
        return [head, "", f"No release newer than {g.src.version} on the index.", ""]
    lines = [head, "", "| patch | " + " | ".join(g.todo) + " |", "|---|" + "---|" * len(g.todo)]
    for i, p in enumerate(g.patches):
        lines.append(f"| {p.name} | " + " | ".join(g.columns[v][i] for v in g.todo) + " |")
    lines.append("| **overlay drift findings** | "
                 + " | ".join(str(len(g.drifts[v])) for v in g.todo) + " |")
    return lines + [""]


def drift_section(groups: list[Group]) -> list[str]:
    lines = ["## Overlay drift", "",
             "`afdtool drift --to X`: static AST check of the overlay's `vllm` imports, attribute"
             " uses of imported vllm modules and keyword calls against release X, relative to the"
             " starting target (a module deleted, a name that resolves there but not in X, or a"
             " parameter list changed other than by added optional parameters).", ""]
    for g in groups:
        for v in g.todo:
            found = g.drifts[v]
            lines += [f"### {v} (relative to {g.src.version}): {len(found)} finding(s)", ""]
            lines += [f"- `{name}` ({where}): {status}" for name, where, status in found[:40]]
            if len(found) > 40:
                lines.append(f"- ... {len(found) - 40} more (`make drift VLLM_VERSION={v}`)")
            if found:
                lines.append("")
    return lines


def timing_section(groups: list[Group]) -> list[str]:
    lines = ["## Timing per release", "",
             "| release | from | fetch + unpack (s) | series (s) | drift (s) | total (s) |",
             "|---|---|---|---|---|---|"]
    for g in groups:
        for v in g.todo:
            if v in g.cached:
                lines.append(f"| {v} | {g.src.version} | cached | cached | cached | cached |")
                continue
            a, b, c = g.timing[v]
            lines.append(f"| {v} | {g.src.version} | {a:.1f} | {b:.1f} | {c:.1f} |"
                         f" {a + b + c:.1f} |")
    lines += ["", "Fetch time is near zero when the sdist is already in the download cache "
              "(first download: about 40 MB per release); `cached`: the result of an earlier "
              "run for the same release and inputs."]
    return lines


def stale_problems(doc: Path, root: Path) -> list[str]:
    """Why `doc` (docs/upstream-status.md) is not current ([] when it is)."""
    if not doc.is_file():
        return [f"{doc} is missing: run `make rebase-report`"]
    m = MARKER_RE.search(doc.read_text())
    if not m:
        return [f"{doc} has no afd-rebase-report marker (made by an older afdtool): run "
                "`make rebase-report`"]
    target, rev, froms = m.groups()
    lines = carried(root)
    if target != lines[-1]:
        return [f"{doc} reports the series of {target}, but the newest carried target is "
                f"{lines[-1]}: run `make rebase-report`"]
    if (froms or target).split(",") != lines:
        return [f"{doc} starts from {froms or target} only, not from every carried target "
                f"({', '.join(lines)}): run `make rebase-report` (without FROM)"]
    now = report_revision([resolve(root, v) for v in lines])
    if now != rev:
        return [f"{doc} was made for report revision {rev}; it is {now} now (a patch or the "
                "series of a carried target changed): run `make rebase-report` and commit the "
                "file"]
    return []


def add_arguments(p) -> None:
    p.add_argument("--releases", nargs="*",
                   help="releases (default: all newer than the primary pin; with --target Y, "
                   "all newer than Y)")
    p.add_argument("--out", type=Path, help="markdown file (default: stdout)")
    p.add_argument("--verify", action="store_true",
                   help="no network: exit 1 when --out is stale (not the default report of "
                   "the newest carried target, or a carried series changed since)")


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
    if args.target_default:
        print("rebase-report: each release from the newest carried target older than it "
              f"(newest: {src.describe()}; --target Y / FROM=Y for one series alone)")
    else:
        print(f"rebase-report: the series of {src.describe()} (--target)")
    releases = [r for a in (args.releases or []) for r in a.replace(",", " ").split()]
    return rebase_report(src, releases or None, args.out, chain=args.target_default)
