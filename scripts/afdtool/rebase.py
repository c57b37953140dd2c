"""Carry the patch series to another upstream release: the rebase state machine.

Commands (see docs/rebasing.md):

* `rebase --to X`        from the newest carried target older than X (or `--target Y`): X's sdist
                         (sha256 from the index) -> base tree, overlay commit, then each patch
                         replayed alone and classified clean / offset / three-way / resolved /
                         dropped. Stops on a conflict (tree left in the `git am` state; a file
                         upstream deleted is named as such) or on a patch that became empty.
                         State: TREE/.git/afd-rebase.json.
* `rebase-continue`      after resolving (`git add`; a file upstream deleted is refused), or
                         `--skip` to drop the current patch.
* `rebase-abort`         restores the tree exactly as it was (HEAD, branch, refs, files).

At the end of a rebase the new series is exported to targets/X/patches/ and
targets/X/VLLM_VERSION is written only when `check` passes for X. `drift` and `rebase-report`
live in drift.py and report.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from . import targets
from .apply import (
    BASE_TAG,
    commit_overlay,
    init_tree,
    prepare_base,
    read_state,
    reset_to_base,
    state_path,
    update_base,
    write_state,
)
from .errors import AfdError
from .export import FORMAT_PATCH_CONFIG, FORMAT_PATCH_FLAGS
from .gitutil import am_in_progress, git, rev_parse, run_git, status_porcelain
from .index import pin_text, release_base, release_pin, torch_of
from .series import overlay_files, read_series, require_clean_series
from .targets import Target, vkey

STATE_NAME = "afd-rebase.json"
BACKUP_NS = "refs/afd-backup/"
OLD_BASE_REF = "refs/afd-rebase/old-base"
AM_BASE = ("am", "-q", "--keep", "--whitespace=nowarn", "--committer-date-is-author-date",
           "--no-gpg-sign")
# The three-way fallback without rename detection: a file upstream deleted must stop as a
# modify/delete of that file, not be merged into whichever new file resembles it (vLLM
# 0.34.0 deleted olmoe.py, and git merged the OLMoE hunks into gemma2.py).
AM_3WAY = ("-c", "merge.renames=false", *AM_BASE, "-3")


# ---------------------------------------------------------------- replaying one patch


HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", re.M)


def hunk_positions(text: str) -> list[tuple[str, str]]:
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[-1]
        elif line.startswith("@@ ") and current:
            m = HUNK_RE.match(line)
            if m:
                out.append((current, m.group(0)))
    return out


def unmerged(tree: Path) -> list[str]:
    return [p for p in git(tree, "diff", "--name-only", "--diff-filter=U").splitlines() if p]


def seed_old_objects(tree: Path, old_pristine: Path, patches: list[Path]) -> None:
    """Make the blobs the patches were made against available, so `git am -3` can merge."""
    run_git(tree, "fetch", "-q", "--no-tags", str(old_pristine),
            f"+refs/tags/{BASE_TAG}:{OLD_BASE_REF}")
    fd, idx = tempfile.mkstemp(prefix="afd-seed-index-")
    os.close(fd)
    try:
        env = {"GIT_INDEX_FILE": idx}
        run_git(tree, "read-tree", OLD_BASE_REF, env_extra=env)
        for p in patches:
            run_git(tree, "apply", "--cached", str(p), env_extra=env, check=False)
    finally:
        os.unlink(idx)


def try_patch(tree: Path, patch: Path) -> str:
    """Apply one patch: clean | offset | three-way | empty | conflict (am state left)."""
    head = rev_parse(tree, "HEAD")
    if run_git(tree, "apply", "--check", str(patch), check=False).returncode == 0:
        if run_git(tree, *AM_BASE, "--no-3way", str(patch), check=False).returncode == 0:
            if rev_parse(tree, "HEAD") == head:
                return "empty"
            mine = hunk_positions(patch.read_text(errors="replace"))
            again = git(tree, *FORMAT_PATCH_CONFIG, "format-patch", *FORMAT_PATCH_FLAGS,
                        "--stdout", "-1", "HEAD")
            return "clean" if hunk_positions(again) == mine else "offset"
        abort_am(tree)
    proc = run_git(tree, *AM_3WAY, str(patch), check=False)
    if proc.returncode == 0:
        return "three-way" if rev_parse(tree, "HEAD") != head else "empty"
    if am_in_progress(tree) and not unmerged(tree) and not status_porcelain(tree):
        return "empty"
    return "conflict"


def abort_am(tree: Path) -> None:
    if am_in_progress(tree) and run_git(tree, "am", "--abort", check=False).returncode:
        shutil.rmtree(tree / ".git" / "rebase-apply", ignore_errors=True)
        run_git(tree, "reset", "-q", "--hard", "HEAD")


def conflict_hunks(tree: Path, max_lines: int | None = 120, hunk_lines: int | None = 40) -> str:
    """The conflicting hunks (`git diff` of the unmerged files, only hunks with markers); None
    limits: whole hunks (`--full-hunks`)."""
    text = git(tree, "diff", "--", *unmerged(tree)) if unmerged(tree) else ""
    out: list[str] = []
    header: list[str] = []
    hunk: list[str] = []

    def flush():
        if hunk and any(re.match(r"^[ +-]{1,2}(<<<<<<<|>>>>>>>|=======)", ln) for ln in hunk):
            if header:
                out.extend(header)
                header.clear()
            cut = hunk_lines is not None and len(hunk) > hunk_lines
            out.extend(hunk[:hunk_lines] + ([f"  ... (hunk trimmed at {hunk_lines} lines: "
                                             "REBASE_ARGS=--full-hunks shows it whole)"]
                                            if cut else []))

    for ln in text.splitlines():
        if ln.startswith("diff --"):
            flush()
            hunk = []
            header = [ln]
        elif ln.startswith("@@"):
            flush()
            hunk = [ln]
        elif hunk:
            hunk.append(ln)
    flush()
    if max_lines is not None and len(out) > max_lines:
        out = out[:max_lines] + [f"... ({len(out) - max_lines} more lines: git diff in the tree)"]
    return "\n".join(out) or "(no conflict markers: see `git am --show-current-patch=diff`)"


def deleted_upstream(tree: Path) -> list[str]:
    """Unmerged files the new upstream deleted and the patch modifies (modify/delete: `DU`)."""
    out = git(tree, "status", "--porcelain", "--untracked-files=no")
    return sorted(ln[3:] for ln in out.splitlines() if ln[:2] == "DU")


def readded(tree: Path, files: list[str]) -> list[str]:
    """Of the files upstream deleted, those staged again (in the index) in the tree."""
    return [f for f in files if run_git(tree, "cat-file", "-e", f":0:{f}", check=False)
            .returncode == 0]


def patch_files(patch: Path) -> list[str]:
    return sorted({f for f, _ in hunk_positions(patch.read_text(errors="replace"))}
                  | set(re.findall(r"^diff --git a/(\S+) ", patch.read_text(errors="replace"),
                                   re.M)))


def upstream_range(state: dict, files: list[str]) -> str:
    src = state.get("source") or ""
    if src.startswith("git:") and Path(src[4:]).expanduser().is_dir():
        repo = Path(src[4:]).expanduser()
        rng = f"v{state['from']}..v{state['to']}"
        proc = run_git(repo, "log", "--oneline", "--no-decorate", "-n", "20", rng, "--", *files,
                       check=False)
        if proc.returncode == 0:
            lines = proc.stdout.decode(errors="replace").strip()
            return f"{rng} (git {repo}):\n    " + (lines.replace("\n", "\n    ") or "(none)")
    return "unknown (sdist has no history)"


# ---------------------------------------------------------------- state and backup


def rstate_path(tree: Path) -> Path:
    return tree / ".git" / STATE_NAME


def save(state: dict) -> None:
    p = rstate_path(Path(state["tree"]))
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, p)


def all_refs(tree: Path) -> dict[str, str]:
    out = git(tree, "for-each-ref", "--format=%(refname) %(objectname)")
    return dict(line.split(" ", 1) for line in out.splitlines() if line)


def backup_tree(tree: Path) -> dict:
    sym = run_git(tree, "symbolic-ref", "-q", "HEAD", check=False)
    refs = all_refs(tree)
    for ref, sha in refs.items():
        run_git(tree, "update-ref", BACKUP_NS + ref[len("refs/"):], sha)
    sp = state_path(tree)
    return {"head_ref": sym.stdout.decode().strip() if sym.returncode == 0 else None,
            "head": rev_parse(tree, "HEAD"), "refs": refs,
            "afd_state": sp.read_text() if sp.is_file() else None}


def restore_tree(tree: Path, backup: dict) -> None:
    abort_am(tree)
    want = backup["refs"]
    for ref in all_refs(tree):
        if ref not in want:
            run_git(tree, "update-ref", "-d", ref)
    for ref, sha in want.items():
        run_git(tree, "update-ref", ref, sha)
    if backup["head_ref"]:
        run_git(tree, "symbolic-ref", "HEAD", backup["head_ref"])
    else:
        run_git(tree, "update-ref", "--no-deref", "HEAD", backup["head"])
    run_git(tree, "reset", "-q", "--hard", "HEAD")
    run_git(tree, "clean", "-q", "-f", "-d")
    sp = state_path(tree)
    if backup["afd_state"] is None:
        sp.unlink(missing_ok=True)
    else:
        sp.write_text(backup["afd_state"])


def drop_backup_refs(tree: Path) -> None:
    for ref in all_refs(tree):
        if ref.startswith(BACKUP_NS) or ref == OLD_BASE_REF:
            run_git(tree, "update-ref", "-d", ref)


def load_state(tree: Path) -> dict:
    try:
        state = json.loads(rstate_path(tree).read_text())
    except (OSError, ValueError):
        raise AfdError(f"no rebase in progress in {tree} (no .git/{STATE_NAME})") from None
    if state.get("status") == "done":
        raise AfdError(f"the rebase in {tree} is finished (to {state['to']}); nothing to do")
    return state


def find_tree(root: Path, tree_arg, to) -> Path:
    """The tree of the rebase in progress: --tree, AFD_BUILD_TREE, X's tree, or the one under build/."""
    if tree_arg:
        return Path(tree_arg).absolute()
    if to:
        return targets.planned(root, {"VERSION": to}).tree
    if os.environ.get("AFD_BUILD_TREE"):
        return Path(os.environ["AFD_BUILD_TREE"]).absolute()
    found = []
    for p in sorted((root / "build").glob(f"*/.git/{STATE_NAME}")):
        try:
            if json.loads(p.read_text()).get("status") != "done":
                found.append(p.parents[1])
        except (OSError, ValueError):
            continue
    if len(found) == 1:
        return found[0]
    if not found:
        raise AfdError(f"no rebase in progress under {root / 'build'}; pass --tree DIR")
    raise AfdError("several rebases in progress, pass --tree: " + ", ".join(map(str, found)))


# ---------------------------------------------------------------- rebase


def rebase(src: Target, to: str, tree_arg=None, source=None, drop_empty=False, torch=None,
           full_hunks=False) -> int:
    """Carry `src`'s series to release `to`: targets/`to`/ (its tree by default build/vllm-to)."""
    if vkey(to) == vkey(src.version):
        raise AfdError(f"the series is already pinned to {to}")
    patches = require_clean_series(src, read_series(src))
    values = release_pin(to, source, torch)
    out = targets.planned(src.root, values, tree_arg)
    tree = out.tree
    if rstate_path(tree).is_file():
        try:
            old = json.loads(rstate_path(tree).read_text())
        except ValueError:
            old = {}
        if old.get("status") != "done":
            raise AfdError(f"a rebase is already in progress in {tree}: `make rebase-continue` "
                           "or `make rebase-abort`")
    pristine, sha = release_base(values, source)
    values["TORCH"] = values["TORCH"] or torch_of(pristine) or src.pin.get("TORCH")
    old_pristine, _ = prepare_base(src, None)
    created = not (tree.exists() and any(tree.iterdir()))
    if not created:
        if not (tree / ".git").is_dir() or not rev_parse(tree, BASE_TAG):
            raise AfdError(f"{tree} exists but is not a tree made by afdtool; choose another "
                           "--tree")
        if am_in_progress(tree) or status_porcelain(tree):
            raise AfdError(f"{tree} has uncommitted changes or a `git am` in progress; commit "
                           "or export them first (the rebase must be able to restore it)")
    if not created:
        rstate_path(tree).unlink(missing_ok=True)
    state = {"format": 2, "status": "running", "to": to, "from": src.version,
             "from_target": src.version, "source": source or "", "pin": values,
             "archive_sha256": sha, "tree": str(tree), "created": created,
             "drop_empty": drop_empty, "full_hunks": full_hunks,
             "patches": [str(p) for p in patches], "results": [], "deleted_upstream": [],
             "repo_root": str(src.root), "current": 0, "stop": None, "stop_head": None,
             "started": time.time()}
    if created:
        if tree.exists():
            tree.rmdir()
        init_tree(tree, pristine)
    else:
        state["backup"] = backup_tree(tree)
        update_base(tree, pristine)
        reset_to_base(tree)
    save(state)
    try:
        seed_old_objects(tree, old_pristine, patches)
        commit_overlay(tree, src)
    except AfdError as exc:
        raise AfdError(f"{exc}\n(`make rebase-abort` restores {tree})") from None
    print(f"rebase {src.version} -> {to}: tree {tree}, {len(patches)} patches")
    return replay(state)


def replay(state: dict) -> int:
    tree = Path(state["tree"])
    patches = [Path(p) for p in state["patches"]]
    while state["current"] < len(patches):
        patch = patches[state["current"]]
        head = rev_parse(tree, "HEAD")
        result = try_patch(tree, patch)
        if result == "empty" and state["drop_empty"]:
            abort_am(tree)
            result = "dropped"
        if result in ("conflict", "empty"):
            state.update(status="stopped", stop=result, stop_head=head)
            save(state)
            print_stop(state, patch, result)
            return 1
        record(state, patch, result)
    return finish(state)


def record(state: dict, patch: Path, result: str) -> None:
    tree = Path(state["tree"])
    state["results"].append({"patch": patch.name, "result": result,
                             "commit": rev_parse(tree, "HEAD") if result != "dropped" else None})
    state.update(current=state["current"] + 1, stop=None, stop_head=None, status="running")
    save(state)
    print(f"  {patch.name}: {result}")


def print_stop(state: dict, patch: Path, result: str) -> None:
    tree = Path(state["tree"])
    n, total = state["current"] + 1, len(state["patches"])
    files = unmerged(tree) or patch_files(patch)
    print(f"\nSTOPPED at patch {n} of {total}: {patch.name}")
    if result == "empty":
        print("  result: the patch became EMPTY: release "
              f"{state['to']} already contains its change.\n"
              f"  files: {', '.join(patch_files(patch))}\n"
              f"  next step: `make rebase-continue REBASE_ARGS=--skip` drops it (or commit a "
              f"replacement in {tree}, then `make rebase-continue`), or `make rebase-abort`.")
        return
    gone = deleted_upstream(tree)
    if gone:
        state["deleted_upstream"] = sorted(set(state.get("deleted_upstream", [])) | set(gone))
        save(state)
        print(f"  result: CONFLICT: upstream {state['to']} DELETED file(s) this patch modifies:\n"
              + "".join(f"    {f}\n" for f in gone)
              + f"  the patch's hunks there: git -C {tree} am --show-current-patch=diff -- "
              + " ".join(gone) + "\n"
              f"  next step: carry the hook to where upstream moved that code (commit it in "
              f"{tree}), then `git -C {tree} rm` the deleted file(s) (do NOT `git add` them: that "
              f"re-adds upstream code {state['to']} removed) and `make rebase-continue`; or drop "
              f"the patch: `make rebase-continue REBASE_ARGS=--skip`; or `make rebase-abort`.")
        others = [f for f in unmerged(tree) if f not in gone]
        if not others:
            return
        print(f"  other conflicted files: {', '.join(others)}")
    print(f"  result: CONFLICT (three-way merge failed)\n"
          f"  conflicted files: {', '.join(unmerged(tree)) or '(none unmerged; see git status)'}\n"
          f"  upstream commits touching them: {upstream_range(state, files)}\n"
          "  conflicting hunks:")
    limits = (None, None) if state.get("full_hunks") else (120, 40)
    print("    " + conflict_hunks(tree, *limits).replace("\n", "\n    "))
    print(f"  patch message: git -C {tree} am --show-current-patch=diff")
    print(f"  next step: edit the files in {tree}, `git add` them, then `make rebase-continue`, "
          f"or `make rebase-abort`.")


def rebase_continue(tree: Path, skip: bool = False) -> int:
    state = load_state(tree)
    if state["status"] != "stopped":
        return replay(state)  # interrupted while running: resume
    patch = Path(state["patches"][state["current"]])
    moved = rev_parse(tree, "HEAD") != state["stop_head"]
    if skip:
        abort_am(tree)
        if moved:
            raise AfdError(f"{tree}: HEAD moved since the stop; reset it to "
                           f"{state['stop_head'][:12]} before --skip")
        record(state, patch, "dropped")
    elif am_in_progress(tree):
        back = readded(tree, state.get("deleted_upstream", []))
        if back:
            raise AfdError(f"upstream {state['to']} deleted {', '.join(back)}, and the "
                           "resolution adds it back; carry the hook to the code that replaced "
                           f"it, then `git -C {tree} rm --cached` / `git rm` the file(s) (or "
                           "--skip to drop the patch)")
        left = unmerged(tree)
        if left:
            raise AfdError("still unmerged (edit, then `git add`): " + ", ".join(left))
        markers = git(tree, "diff", "--cached", "--check", check=False)
        if "conflict marker" in markers:
            raise AfdError("conflict markers are still staged:\n  " + markers[:2000])
        proc = run_git(tree, "am", "--continue", check=False)
        if proc.returncode or rev_parse(tree, "HEAD") == state["stop_head"]:
            msg = (proc.stdout + proc.stderr).decode(errors="replace").strip()
            raise AfdError(f"`git am --continue` failed in {tree}:\n  {msg}\n"
                           "If the resolution leaves nothing to change, drop the patch with "
                           "`make rebase-continue REBASE_ARGS=--skip`.")
        record(state, patch, "resolved")
    elif moved:
        record(state, patch, "resolved")  # resolved with `git am --continue` / a commit
    else:
        raise AfdError(f"{patch.name} is neither resolved nor skipped: resolve it in {tree} "
                       "(`git add`), or pass --skip to drop it")
    return replay(state)


def rebase_abort(tree: Path) -> int:
    state = load_state(tree)
    if state.get("created"):
        shutil.rmtree(tree)
        print(f"rebase to {state['to']} aborted: removed {tree} (it did not exist before)")
        return 0
    restore_tree(tree, state["backup"])
    rstate_path(tree).unlink(missing_ok=True)
    print(f"rebase to {state['to']} aborted: {tree} restored "
          f"(HEAD {state['backup']['head'][:12]}, {len(state['backup']['refs'])} refs)")
    return 0


def finish(state: dict) -> int:
    from .check import check
    from .export import export

    tree = Path(state["tree"])
    root = Path(state["repo_root"])
    src = targets.resolve(root, state.get("from_target") or state["from"])
    out = targets.planned(root, state["pin"], tree)
    out.patches.mkdir(parents=True, exist_ok=True)
    if not out.series_file.is_file():
        header = read_series(src).header
        out.series_file.write_text("\n".join(header) + "\n" if header else "")
    # Export the patches only: overlay/ is shared by all targets (and may be edited by others
    # meanwhile), so the tree's overlay goes to a scratch folder and is compared, never written.
    with tempfile.TemporaryDirectory(prefix="afd-rebase-overlay-") as scratch:
        changes = [c for c in export(out.with_overlay(Path(scratch)), tree, force=True)
                   if " overlay/" not in c]
        mine, theirs = overlay_files(Path(scratch)), overlay_files(src.overlay)
        differ = sorted(rel for rel in set(mine) | set(theirs)
                        if rel not in mine or rel not in theirs
                        or mine[rel].read_bytes() != theirs[rel].read_bytes())
    if differ:
        print("note: overlay/ differs from the tree's overlay (changed in the tree during the "
              "rebase, or in overlay/ since it started); overlay/ was NOT written: "
              + ", ".join(differ))
    st = read_state(tree) or {}
    write_state(tree, **dict(st, archive_sha256=state["archive_sha256"], source=state["source"],
                             by="rebase"))
    for c in changes:
        print(f"  {c}")
    print(f"\nrebase {state['from']} -> {state['to']}:")
    width = max(len(r["patch"]) for r in state["results"]) if state["results"] else 10
    print(f"  {'patch':<{width}}  result")
    for r in state["results"]:
        print(f"  {r['patch']:<{width}}  {r['result']}")
    print(f"\nexported -> {out.patches_label}; running check for {state['to']} ...")
    ok = check(out, source=state["source"] or None)
    pin_label = f"{out.patches_label.rsplit('/', 1)[0]}/VLLM_VERSION"
    if ok:
        out.pin.path.parent.mkdir(parents=True, exist_ok=True)
        out.pin.path.write_text(pin_text(state["pin"]))
        print(f"check passed: wrote {pin_label}")
    else:
        print(f"check FAILED: {pin_label} not written/updated; fix, then `make check "
              f"VLLM_VERSION={state['to']}`")
    drop_backup_refs(tree)
    state.update(status="done", finished=time.time(), check="pass" if ok else "fail")
    save(state)
    return 0 if ok else 1


# ---------------------------------------------------------------- CLI


def add_rebase_arguments(p) -> None:
    p.add_argument("--to", required=True, metavar="X", help="upstream release to carry to")
    p.add_argument("--source", help="where to get X's sdist (see `afdtool fetch --help`)")
    p.add_argument("--drop-empty", action="store_true",
                   help="drop patches that became empty instead of stopping")
    p.add_argument("--torch", help="TORCH for the new pin (default: from X's requirements)")
    p.add_argument("--full-hunks", action="store_true",
                   help="show conflicting hunks whole (default: 40 lines a hunk, 120 in all)")


def run_rebase(args) -> int:
    src = args.target
    how = ("the newest carried target (--target Y / make rebase FROM=Y for another)"
           if args.target_default else "--target")
    print(f"rebase: starting from {src.describe()}: {how}")
    return rebase(src, args.to, args.tree, args.source, args.drop_empty, args.torch,
                  args.full_hunks)


def add_continue_arguments(p) -> None:
    p.add_argument("--to", metavar="X", help="find the tree of the rebase to X")
    p.add_argument("--skip", action="store_true", help="drop the current patch")


def run_continue(args) -> int:
    return rebase_continue(find_tree(args.target.root, args.tree, args.to), skip=args.skip)


def add_abort_arguments(p) -> None:
    p.add_argument("--to", metavar="X", help="find the tree of the rebase to X")


def run_abort(args) -> int:
    return rebase_abort(find_tree(args.target.root, args.tree, args.to))


# __main__ loads modules by attribute name: one (add_arguments, run) pair per command.
COMMANDS = {
    "rebase": (add_rebase_arguments, run_rebase),
    "rebase-continue": (add_continue_arguments, run_continue),
    "rebase-abort": (add_abort_arguments, run_abort),
}
