"""`make export-patches`: commits after afd/overlay in the build tree -> patches/ + overlay/.

Rules:
- A file that is not in afd/base's tree (upstream) is an overlay file. Changes to overlay files
  are copied back to overlay/ (contents of HEAD; files deleted in HEAD are deleted) and never
  appear in patches. A commit that touches both is split: its upstream part becomes the patch,
  its overlay part goes to overlay/. A commit that touches only overlay files produces no patch.
- Patches are written with pinned `git format-patch` flags, so apply-then-export is byte-stable.
- Only files whose bytes change are written; NNNN-*.patch files listed in the old series but not
  produced any more are deleted; patches/series keeps its leading comment lines.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .apply import BASE_TAG, OVERLAY_TAG, read_state, write_state
from .errors import AfdError
from .gitutil import am_in_progress, git, ls_tree_files, rev_parse, run_git, status_porcelain
from .series import (
    OWNED_PATCH_RE,
    inputs_fingerprint,
    overlay_files,
    read_series,
)
from .targets import Target

FORMAT_PATCH_CONFIG = (
    "-c", "core.abbrev=12",
    "-c", "diff.noprefix=false",
    "-c", "format.signature=",
    "-c", "diff.mnemonicPrefix=false",
    "-c", "format.useAutoBase=false",
    "-c", "format.suffix=.patch",
)
FORMAT_PATCH_FLAGS = (
    "--zero-commit", "--full-index", "--no-signature", "--no-stat", "--keep-subject",
    "--no-numbered", "--no-renames", "--no-color", "--no-thread", "--encoding=UTF-8",
    "--start-number=1",
)
DEFAULT_HEADER = ["# AFD patch series for vLLM (one patch file name per line, applied in order)."]


def format_patches(tree: Path, outdir: Path, exclude: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """afd/overlay..HEAD as patch files in outdir, without the paths in exclude."""
    args = [*FORMAT_PATCH_CONFIG, "format-patch", *FORMAT_PATCH_FLAGS, "-o", str(outdir),
            f"{OVERLAY_TAG}..HEAD"]
    if exclude:
        args += ["--", *(f":(exclude,literal){p}" for p in sorted(exclude))]
    out = git(tree, *args)
    return [Path(line) for line in out.splitlines() if line.strip()]


def changed_paths(tree: Path, commit: str) -> list[str]:
    out = run_git(tree, "diff-tree", "-r", "-z", "--no-renames", "--no-commit-id", "--name-only",
                  f"{commit}^", commit).stdout.decode(errors="surrogateescape")
    return [p for p in out.split("\0") if p]


def require_exportable(tree: Path) -> None:
    if not (tree / ".git").is_dir() or not rev_parse(tree, OVERLAY_TAG):
        raise AfdError(f"{tree} is not a tree made by `make apply-patches` (no {OVERLAY_TAG} tag)")
    if am_in_progress(tree):
        raise AfdError(f"{tree}: a `git am` is in progress; finish it (git am --continue) or "
                       "abort it (git am --abort) before exporting")
    dirty = status_porcelain(tree)
    if dirty:
        raise AfdError(f"{tree} has uncommitted changes; commit them (or stash them) first:\n  "
                       + "\n  ".join(dirty[:30]))
    if run_git(tree, "merge-base", "--is-ancestor", OVERLAY_TAG, "HEAD", check=False).returncode:
        raise AfdError(f"{tree}: HEAD does not descend from {OVERLAY_TAG} (was the overlay commit "
                       "rewritten?). Change overlay files in later commits instead.")
    merges = git(tree, "rev-list", "--merges", f"{OVERLAY_TAG}..HEAD")
    if merges:
        raise AfdError(f"{tree}: merge commits after {OVERLAY_TAG} cannot be exported "
                       f"({merges.split()[0][:12]}); linearize the history (git rebase)")


def tree_overlay(tree: Path, dest: Path) -> Path:
    """The overlay `tree` was built with (the files afd/overlay adds to afd/base) -> dest."""
    base = ls_tree_files(tree, BASE_TAG)
    for rel, mode in ls_tree_files(tree, OVERLAY_TAG).items():
        if rel in base:
            continue
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(run_git(tree, "show", f"{OVERLAY_TAG}:{rel}").stdout)
        os.chmod(dst, 0o755 if mode == "100755" else 0o644)
    return dest


def export_patches_only(repo: Target, tree: Path, force: bool = False) -> list[str]:
    """Export the patches alone: overlay/ is neither compared with the tree's nor written (it
    is shared by every target and may have moved on since the tree was built)."""
    with tempfile.TemporaryDirectory(prefix="afd-export-overlay-") as scratch:
        changes = export(repo.with_overlay(tree_overlay(tree, Path(scratch))), tree, force,
                         patches_only=True)
    left = [c for c in changes if " overlay/" in c]
    if left:
        print("note: overlay/ NOT written (--patches-only); the tree changed: "
              + ", ".join(c.split(" ", 1)[1] for c in left))
    return [c for c in changes if " overlay/" not in c]


def export(repo: Target, tree: Path, force: bool = False, patches_only: bool = False) -> list[str]:
    """Export; returns the list of human-readable changes (empty = nothing changed)."""
    require_exportable(tree)
    state = read_state(tree) or {}
    source = state.get("source") or None
    if not force:
        refuse_lost_work(repo, tree, state, patches_only)
    base = ls_tree_files(tree, BASE_TAG)
    head = ls_tree_files(tree, "HEAD")
    notes, excluded = split_commits(tree, base)
    new_overlay = {p: m for p, m in head.items() if p not in base}
    changes = write_overlay(repo, tree, new_overlay)
    names, written = write_patches(repo, tree, excluded, notes)
    changes += written
    # The tree now corresponds to the exported inputs: a following apply is a no-op.
    write_state(tree, **dict(state, inputs=inputs_fingerprint(repo, source), status="ok",
                             head=rev_parse(tree, "HEAD"), series=names, by="export",
                             overlay=sorted(new_overlay), format=1))
    for n in notes:
        print(f"note: {n}")
    return changes


def refuse_lost_work(repo: Target, tree: Path, state: dict, patches_only: bool) -> None:
    """AfdError where the export would overwrite work: inputs changed since the tree was
    built, patches an apply that stopped early never committed, or uncommitted edits in
    patches/ (and overlay/, unless ``patches_only``)."""
    if state.get("inputs") != inputs_fingerprint(repo, state.get("source") or None):
        raise AfdError(
            f"patches/, overlay/ or the pin changed since {tree} was built, so exporting "
            "would overwrite those changes. Run `make apply-patches` first (it refuses if "
            "that would lose tree work), or pass --force to overwrite them from the tree."
        )
    n_commits = len(git(tree, "rev-list", f"{OVERLAY_TAG}..HEAD").split())
    if state.get("status") == "failed" and n_commits < len(state.get("series", [])):
        raise AfdError(
            f"the last `make apply-patches` stopped early and {tree} holds only {n_commits} "
            f"of {len(state['series'])} patches; exporting would drop the rest. Re-run "
            "`make apply-patches`, or pass --force if dropping them is intended."
        )
    # The export's own uncommitted output (state recorded by export, inputs unchanged
    # since) is not user work; anything else uncommitted in patches/ or overlay/ is.
    if (repo.root / ".git").exists() and state.get("by") != "export":
        dirty = status_porcelain(repo.root, repo.patches_label,
                                 *(() if patches_only else ("overlay",)))
        if dirty:
            raise AfdError(
                f"{repo.root} has uncommitted changes in patches/ or overlay/ that an export "
                "would overwrite; commit them first or pass --force:\n  " + "\n  ".join(dirty)
            )


def split_commits(tree: Path, base: dict[str, str]) -> tuple[list[str], set[str]]:
    """Notes on the commits after afd/overlay that touch overlay files (split, or no
    patch at all), and those overlay paths (left out of the patches)."""
    notes: list[str] = []
    excluded: set[str] = set()
    for commit in git(tree, "rev-list", "--reverse", f"{OVERLAY_TAG}..HEAD").split():
        paths = changed_paths(tree, commit)
        ov = [p for p in paths if p not in base]
        up = [p for p in paths if p in base]
        excluded.update(ov)
        subject = git(tree, "log", "-1", "--format=%s", commit)
        if ov and up:
            notes.append(f"split {commit[:12]} {subject!r}: {len(ov)} overlay file(s) -> overlay/")
        elif ov:
            notes.append(f"{commit[:12]} {subject!r} touches only overlay files -> no patch")
    return notes, excluded


def write_overlay(repo: Target, tree: Path, new_overlay: dict[str, str]) -> list[str]:
    """overlay/ made equal to the tree's overlay files (path -> git mode); the changes."""
    for rel, mode in new_overlay.items():
        if mode not in ("100644", "100755"):
            raise AfdError(f"{tree}/{rel}: overlay files must be regular files (mode {mode})")
    changes: list[str] = []
    old_overlay = overlay_files(repo.overlay)
    for rel, mode in sorted(new_overlay.items()):
        data = (tree / rel).read_bytes()
        dst = repo.overlay / rel
        want_x = mode == "100755"
        if rel in old_overlay and dst.read_bytes() == data and os.access(dst, os.X_OK) == want_x:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        os.chmod(dst, 0o755 if want_x else 0o644)
        changes.append(f"{'updated' if rel in old_overlay else 'added'} overlay/{rel}")
    for rel in sorted(set(old_overlay) - set(new_overlay)):
        old_overlay[rel].unlink()
        changes.append(f"deleted overlay/{rel}")
        d = old_overlay[rel].parent
        while d != repo.overlay and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
    return changes


def write_patches(repo: Target, tree: Path, excluded: set[str],
                  notes: list[str]) -> tuple[list[str], list[str]]:  # fmt: skip
    """patches/ (targets/X/patches/ for a target X) and its series from the tree's commits
    without the ``excluded`` paths; the patch names and the changes (``notes`` gets what
    was left in place)."""
    label = repo.patches_label
    old_series = read_series(repo)
    changes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="afd-export-") as tmp:
        produced = format_patches(tree, Path(tmp), sorted(excluded))
        repo.patches.mkdir(parents=True, exist_ok=True)
        names = [p.name for p in produced]
        for p in produced:
            dst = repo.patches / p.name
            data = p.read_bytes()
            if dst.is_file() and dst.read_bytes() == data:
                continue
            changes.append(f"{'updated' if dst.exists() else 'added'} {label}/{p.name}")
            shutil.copyfile(p, dst)
    for name in old_series.names:
        if name not in names and OWNED_PATCH_RE.match(name) and (repo.patches / name).is_file():
            (repo.patches / name).unlink()
            changes.append(f"deleted {label}/{name}")
        elif name not in names and not OWNED_PATCH_RE.match(name):
            notes.append(f"{label}/{name} is not named NNNN-*.patch, so it was left in place "
                         "(dropped from the series); delete it if the export replaced it")
    header = old_series.header or DEFAULT_HEADER
    series_text = "\n".join([*header, *names]) + "\n"
    if not old_series.path.is_file() or old_series.path.read_text() != series_text:
        old_series.path.write_text(series_text)
        changes.append(f"rewrote {label}/series")
    return names, changes


def add_arguments(parser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="overwrite uncommitted/unapplied changes in patches/ and overlay/")
    parser.add_argument("--patches-only", action="store_true",
                        help="write the target's patches only; overlay/ (shared by every "
                        "target) is neither written nor compared with the tree's")


def run(args) -> int:
    repo = args.target
    tree = repo.tree
    if args.patches_only:
        changes = export_patches_only(repo, tree, force=args.force)
    else:
        changes = export(repo, tree, force=args.force)
    if changes:
        print("\n".join(changes))
        print(f"exported {tree} -> {repo.patches_label} ({len(changes)} change(s))")
    else:
        print("nothing changed")
    return 0
