"""`make check`: the series applies strictly, re-export is byte-identical, headers, compile.

Runs in a temporary tree built from the cached pristine base (no network when the cache is warm).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

from .apply import PatchFailed, am_series, commit_overlay, init_tree, prepare_base
from .errors import AfdError
from .export import changed_paths, format_patches
from .gitutil import run_git
from .series import lint_series, read_series
from .targets import Target

TRAILERS = ("Patch-Id", "Upstream-Status", "Forwarded", "Reason", "Removal")
# Upstream-Status values as OpenEmbedded spells them: the bracketed part says where a patch
# was submitted, or why it does not belong upstream.
STATUS_RE = re.compile(r"^(Pending|Accepted|Backport|Denied|Submitted \[[^\]]+\]"
                       r"|Inappropriate \[[^\]]+\])$")
STATUS_WORDS = "Pending, Submitted [where], Accepted, Backport, Denied or Inappropriate [reason]"
# Forwarded as DEP-3 spells it: no, not-needed, or where the patch was sent (a URL or a
# pull-request reference).
FORWARD_WORDS = ("no", "not-needed")
# A patch's name that docs and code cite: the same on every line that carries the patch
# (its number in the series differs between lines).
PATCH_ID_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def patch_message(data: bytes) -> str:
    """The commit message (subject + body) of a format-patch mail, as `git am -k` sees it."""
    with tempfile.TemporaryDirectory(prefix="afd-mail-") as tmp:
        msg, patch = Path(tmp, "msg"), Path(tmp, "patch")
        proc = run_git(None, "mailinfo", "-k", str(msg), str(patch), input=data)
        subject = ""
        for line in proc.stdout.decode(errors="replace").splitlines():
            if line.startswith("Subject: "):
                subject = line[len("Subject: "):]
        return subject + "\n\n" + msg.read_text(errors="replace")


def patch_trailers(data: bytes) -> dict[str, str]:
    """The trailers of a format-patch mail's message (the first value of each key)."""
    proc = run_git(None, "interpret-trailers", "--parse", input=patch_message(data).encode())
    found: dict[str, str] = {}
    for line in proc.stdout.decode(errors="replace").splitlines():
        key, _, value = line.partition(":")
        found.setdefault(key.strip(), value.strip())
    return found


def trailer_problems(name: str, data: bytes) -> list[str]:
    """What is wrong with the header trailers of the patch file ``name`` (empty: nothing)."""
    found = patch_trailers(data)
    problems = [f"patches/{name}: missing trailer `{t}:`" for t in TRAILERS if t not in found]
    status = found.get("Upstream-Status")
    if status is not None and not STATUS_RE.match(status):
        problems.append(f"patches/{name}: Upstream-Status {status!r} must be one of "
                        + STATUS_WORDS)
    forwarded = found.get("Forwarded")
    if status is not None and forwarded is not None and STATUS_RE.match(status):
        word = status.split(" ", 1)[0]
        if word == "Pending" and forwarded != "no":
            problems.append(f"patches/{name}: Upstream-Status Pending goes with `Forwarded: no`"
                            f", not {forwarded!r}")
        elif word == "Inappropriate" and forwarded != "not-needed":
            problems.append(f"patches/{name}: Upstream-Status Inappropriate goes with "
                            f"`Forwarded: not-needed`, not {forwarded!r}")
        elif word not in ("Pending", "Inappropriate") and forwarded in (*FORWARD_WORDS, ""):
            problems.append(f"patches/{name}: Upstream-Status {word} needs `Forwarded:` to say "
                            f"where the patch went (a URL or a pull-request reference), not "
                            f"{forwarded!r}")
    patch_id = found.get("Patch-Id")
    if patch_id is not None and not PATCH_ID_RE.match(patch_id):
        problems.append(f"patches/{name}: Patch-Id {patch_id!r} must be lower-case words "
                        "joined by '-' (e.g. graph-capture-guard)")
    return problems


def patch_ids(patches: Path, names: list[str]) -> dict[str, str]:
    """Patch-Id -> file name for the listed patches of a series (those that have one)."""
    ids: dict[str, str] = {}
    for name in names:
        f = patches / name
        if f.is_file():
            patch_id = patch_trailers(f.read_bytes()).get("Patch-Id")
            if patch_id:
                ids.setdefault(patch_id, name)
    return ids


def duplicate_id_problems(patches: Path, names: list[str]) -> list[str]:
    seen: dict[str, str] = {}
    problems = []
    for name in names:
        f = patches / name
        if not f.is_file():
            continue
        patch_id = patch_trailers(f.read_bytes()).get("Patch-Id")
        if patch_id and patch_id in seen:
            problems.append(f"patches/{name}: Patch-Id {patch_id!r} is taken by {seen[patch_id]}")
        elif patch_id:
            seen[patch_id] = name
    return problems


def compile_problems(tree: Path, paths: set[str]) -> list[str]:
    problems = []
    for rel in sorted(paths):
        p = tree / rel
        if not rel.endswith(".py") or not p.is_file():
            continue
        try:
            compile(p.read_bytes(), str(rel), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            line = getattr(exc, "lineno", None)
            problems.append(f"{rel}:{line}: {exc.__class__.__name__}: {getattr(exc, 'msg', exc)}")
    return problems


def check(repo: Target, source: str | None = None, keep: Path | None = None) -> bool:
    t0 = time.monotonic()
    results: list[tuple[str, list[str]]] = []
    series = read_series(repo)
    lint = lint_series(repo, series)
    results.append(("series lists exactly the patch files, once each", lint))

    headers = []
    names = list(dict.fromkeys(series.names))
    for name in names:
        f = repo.patches / name
        if f.is_file():
            headers += trailer_problems(name, f.read_bytes())
    headers += duplicate_id_problems(repo.patches, names)
    results.append(("every patch has Patch-Id/Upstream-Status/Forwarded/Reason/Removal "
                    "trailers, Patch-Ids unique", headers))

    tmp = Path(tempfile.mkdtemp(prefix="afd-check-"))
    try:
        tree = tmp / "vllm"
        apply_problems: list[str] = []
        compiled: list[str] = []
        export_problems: list[str] = []
        missing = [n for n in dict.fromkeys(series.names) if not (repo.patches / n).is_file()]
        patches = [repo.patches / n for n in dict.fromkeys(series.names) if n not in missing]
        try:
            pristine, _ = prepare_base(repo, source)
            init_tree(tree, pristine)
            touched = set(commit_overlay(tree, repo))
            compiled += [f"after overlay: {p}" for p in compile_problems(tree, touched)]

            def after_each(patch: Path, n: int) -> None:
                touched.update(changed_paths(tree, "HEAD"))
                compiled.extend(f"after {patch.name}: {p}" for p in compile_problems(tree, touched))

            am_series(tree, patches, after_each=after_each)
        except PatchFailed as exc:
            apply_problems.append(str(exc))
        except AfdError as exc:
            apply_problems.append(str(exc))
        results.append((f"overlay + {len(patches)} patches apply strictly", apply_problems))
        if not apply_problems:
            results.append(("each prefix of the series byte-compiles (touched .py files)", compiled))
            out = tmp / "export"
            out.mkdir()
            produced = {p.name: p for p in format_patches(tree, out)}
            expected = [n for n in series.names if n not in missing]
            if list(produced) != expected:
                export_problems.append(
                    "re-export gives patch names " + ", ".join(produced) + " but the series has "
                    + ", ".join(expected) + " (run `make export-patches`)")
            for name, p in produced.items():
                mine = repo.patches / name
                if mine.is_file() and mine.read_bytes() != p.read_bytes():
                    export_problems.append(f"{repo.patches_label}/{name} differs from its re-export: "
                                           + _first_diff(mine.read_bytes(), p.read_bytes()))
            results.append((f"re-export is byte-identical to {repo.patches_label}/", export_problems))
        if keep:
            shutil.copytree(tree, keep, symlinks=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ok = True
    for title, problems in results:
        print(f"{'PASS' if not problems else 'FAIL'}  {title}")
        for p in problems:
            print("      " + p.replace("\n", "\n      "))
        ok = ok and not problems
    print(f"check: {'PASS' if ok else 'FAIL'} ({len(series.names)} patches, "
          f"{time.monotonic() - t0:.1f}s)")
    return ok


def _first_diff(a: bytes, b: bytes) -> str:
    la, lb = a.split(b"\n"), b.split(b"\n")
    for i, (x, y) in enumerate(zip(la, lb), 1):
        if x != y:
            return f"line {i}: {x[:80]!r} vs re-exported {y[:80]!r}"
    return f"length {len(la)} vs re-exported {len(lb)} lines"


def add_arguments(parser) -> None:
    parser.add_argument("--source", help="where to get the sdist (see `afdtool fetch --help`)")


def run(args) -> int:
    return 0 if check(args.target, source=args.source) else 1


