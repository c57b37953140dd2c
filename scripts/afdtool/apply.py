"""`make apply-patches`: pinned source + overlay/ + patches/series -> build/vllm (a git repo).

Tree layout: commit "upstream vLLM X" (tag afd/base), commit "AFD overlay" (tag afd/overlay),
then one commit per patch of the series (git am, strictly: no fuzz, no 3-way) on branch main.
The inputs that produced the tree are recorded in .git/afd-state.json, so a re-run with the
same inputs is a no-op.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from .errors import AfdError
from .fetch import fetch_artifact, log, sha256_file
from .gitutil import am_in_progress, git, ls_tree_files, rev_parse, run_git, status_porcelain
from .pin import cache_dir
from .series import (
    inputs_fingerprint,
    overlay_files,
    read_series,
    require_clean_series,
)
from .targets import Target

BRANCH = "main"
BASE_TAG = "afd/base"
OVERLAY_TAG = "afd/overlay"
STATE_NAME = "afd-state.json"


# ---------------------------------------------------------------- state


def state_path(tree: Path) -> Path:
    return tree / ".git" / STATE_NAME


def read_state(tree: Path) -> dict | None:
    try:
        return json.loads(state_path(tree).read_text())
    except (OSError, ValueError):
        return None


def write_state(tree: Path, **values) -> None:
    tmp = state_path(tree).with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, state_path(tree))


# ---------------------------------------------------------------- pristine base


def _unpack(archive: Path, dest: Path) -> None:
    """Extract archive into dest, stripping its single top folder; never chown."""
    try:
        tf = tarfile.open(archive)
    except (tarfile.TarError, OSError) as exc:
        raise AfdError(f"{archive}: not a readable tar archive: {exc}") from None
    with tf:
        members = tf.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members if m.name not in ("", ".")}
        if len(tops) != 1:
            raise AfdError(f"{archive}: expected one top folder, found {sorted(tops)[:5]}")
        top = tops.pop() + "/"
        keep = []
        for m in members:
            if m.name.rstrip("/") + "/" == top:
                continue
            m.name = m.name[len(top):]
            if m.islnk() and m.linkname.startswith(top):
                m.linkname = m.linkname[len(top):]
            keep.append(m)
        if hasattr(tarfile, "data_filter"):
            # 'data': no absolute paths / escapes / devices, and no owner (uid/gid) restored.
            tf.extractall(dest, members=keep, filter="data")
        else:  # pragma: no cover - Python without PEP 706
            for m in keep:
                tf.extract(m, dest, set_attrs=False)
                if m.isfile() and m.mode & 0o111:
                    p = dest / m.name
                    p.chmod(p.stat().st_mode | 0o111)


def pristine_repo(archive: Path, version: str, archive_sha: str) -> Path:
    """A bare repo in the cache holding the upstream commit (tag afd/base) for this archive."""
    trees = cache_dir() / "trees"
    trees.mkdir(exist_ok=True)
    final = trees / f"{version}-{archive_sha[:12]}.git"
    if (final / "afd-complete").is_file():
        return final
    t0 = time.monotonic()
    log(f"afdtool: unpacking {archive.name} (first use; cached under {final})")
    tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=trees))
    try:
        work, bare = tmp / "work", tmp / "repo.git"
        work.mkdir()
        _unpack(archive, work)
        run_git(None, "init", "-q", "--bare", str(bare))
        gd = ["--git-dir", str(bare), "--work-tree", str(work)]
        run_git(None, *gd, "add", "-A", "-f", ".")
        run_git(None, *gd, "commit", "-q", "--no-verify", "-m", f"upstream vLLM {version}",
                fixed_identity=True)
        run_git(None, *gd, "tag", BASE_TAG)
        (bare / "afd-complete").write_text(f"{archive.name} {archive_sha}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(bare, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"afdtool: base commit ready in {time.monotonic() - t0:.1f}s")
    return final


def prepare_base(repo: Target, source: str | None) -> tuple[Path, str]:
    archive = fetch_artifact("sdist", repo.pin, source)
    if source and source.startswith("git:"):
        sha = sha256_file(archive)
    else:
        sha = repo.pin.get("SDIST_SHA256").lower()
    return pristine_repo(archive, repo.pin.version, sha), sha


# ---------------------------------------------------------------- tree building


def init_tree(tree: Path, pristine: Path) -> None:
    tree.parent.mkdir(parents=True, exist_ok=True)
    run_git(None, "clone", "-q", "--no-checkout", "--local", str(pristine), str(tree))
    run_git(tree, "remote", "remove", "origin")
    run_git(tree, "checkout", "-q", "-f", "-B", BRANCH, BASE_TAG)
    for ref in git(tree, "for-each-ref", "--format=%(refname:short)", "refs/heads").split():
        if ref != BRANCH:
            run_git(tree, "branch", "-q", "-D", ref)


def update_base(tree: Path, pristine: Path) -> None:
    run_git(tree, "fetch", "-q", "--no-tags", str(pristine), f"+refs/tags/{BASE_TAG}:refs/tags/{BASE_TAG}")


def reset_to_base(tree: Path) -> None:
    if am_in_progress(tree):
        if run_git(tree, "am", "--abort", check=False).returncode != 0:
            shutil.rmtree(tree / ".git" / "rebase-apply", ignore_errors=True)
    run_git(tree, "checkout", "-q", "-f", "-B", BRANCH, BASE_TAG)
    run_git(tree, "clean", "-q", "-f", "-d")


def check_overlay(repo: Target, base_files: dict[str, str]) -> dict[str, Path]:
    files = overlay_files(repo.overlay)
    base_dirs = set()
    for p in base_files:
        parts = p.split("/")
        for i in range(1, len(parts)):
            base_dirs.add("/".join(parts[:i]))
    problems = []
    for rel in files:
        parts = rel.split("/")
        if rel in base_files:
            problems.append(f"overlay/{rel} would replace the upstream file {rel}")
        elif rel in base_dirs:
            problems.append(f"overlay/{rel} would replace the upstream folder {rel}/")
        else:
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in base_files:
                    problems.append(f"overlay/{rel}: upstream {'/'.join(parts[:i])} is a file")
                    break
    if problems:
        raise AfdError(
            "overlay files may not shadow upstream files (change upstream files with a patch "
            "in patches/ instead):\n  " + "\n  ".join(problems)
        )
    return files


def commit_overlay(tree: Path, repo: Target) -> list[str]:
    files = check_overlay(repo, ls_tree_files(tree, BASE_TAG))
    for rel, src in files.items():
        dst = tree / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        mode = 0o755 if os.access(src, os.X_OK) else 0o644
        os.chmod(dst, mode)
    if files:
        run_git(tree, "add", "-f", "--pathspec-from-file=-", "--pathspec-file-nul",
                input="\0".join(files).encode(), env_extra={"GIT_LITERAL_PATHSPECS": "1"})
    run_git(tree, "commit", "-q", "--no-verify", "--allow-empty", "-m", "AFD overlay",
            fixed_identity=True)
    run_git(tree, "tag", "-f", OVERLAY_TAG)
    return list(files)


AM_ARGS = ("am", "-q", "--keep", "--no-3way", "--whitespace=nowarn",
           "--committer-date-is-author-date", "--no-gpg-sign")


def hunk_report(tree: Path, patch: Path) -> str:
    """Explain which file/hunk of patch does not apply at HEAD of tree."""
    proc = run_git(tree, "apply", "--check", "--verbose", str(patch), check=False)
    out = proc.stderr.decode(errors="replace") + proc.stdout.decode(errors="replace")
    lines = []
    m = re.search(r"^error: patch failed: (.+):(\d+)$", out, re.M)
    if m:
        fname, line = m.group(1), int(m.group(2))
        hunks = _hunks(patch.read_bytes().decode("utf-8", errors="replace"), fname)
        for i, (old_start, header) in enumerate(hunks, 1):
            if old_start == line:
                lines.append(f"file {fname}, hunk #{i} of {len(hunks)}: {header}")
                break
        else:
            lines.append(f"file {fname}, hunk at line {line}")
    for what in re.findall(r"^error: (.+: (?:does not exist in index|No such file or directory|"
                           r"already exists in (?:index|working directory)|does not match index))$",
                           out, re.M):
        lines.append(f"file {what}")
    errs = [ln for ln in out.splitlines() if ln.startswith("error:")]
    detail = "\n  ".join(lines) if lines else "(git apply gave no hunk detail)"
    return detail + ("\n  git said:\n    " + "\n    ".join(errs[-6:]) if errs else "")


def _hunks(text: str, fname: str) -> list[tuple[int, str]]:
    hunks, current = [], None
    for ln in text.splitlines():
        if ln.startswith("diff --git "):
            current = ln.split(" b/", 1)[-1] if " b/" in ln else None
            a = ln[len("diff --git a/"):].split(" b/", 1)[0]
            current = fname if fname in (a, current) else None
        elif current and ln.startswith("@@ "):
            m = re.match(r"@@ -(\d+)", ln)
            if m:
                hunks.append((int(m.group(1)), ln))
    return hunks


def am_series(tree: Path, patches: list[Path], after_each=None) -> None:
    """git am the patches strictly; on failure leave the am state and raise with details."""
    if not patches:
        return
    if after_each is None:
        groups = [patches]
    else:
        groups = [[p] for p in patches]
    done = 0
    for group in groups:
        proc = run_git(tree, *AM_ARGS, *map(str, group), check=False)
        if proc.returncode != 0:
            idx = done
            nxt = tree / ".git" / "rebase-apply" / "next"
            if nxt.is_file():
                idx = done + int(nxt.read_text().strip() or 1) - 1
            patch = patches[min(idx, len(patches) - 1)]
            raise PatchFailed(tree, patch, idx + 1, len(patches), hunk_report(tree, patch),
                              proc.stderr.decode(errors="replace"))
        done += len(group)
        if after_each is not None:
            after_each(group[0], done)


class PatchFailed(AfdError):
    def __init__(self, tree, patch, number, total, detail, am_output):
        self.patch = patch
        super().__init__(
            f"patch {patch.name} ({number} of {total}) does not apply strictly to {tree} "
            f"(no fuzz, no 3-way):\n  {detail}"
        )


# ---------------------------------------------------------------- safety


def _backup(tree: Path, reason: str) -> str:
    head = rev_parse(tree, "HEAD")
    stamp = "afd/backup-" + time.strftime("%Y%m%d-%H%M%S")
    name, n = stamp, 1
    while rev_parse(tree, f"refs/heads/{name}"):
        n += 1
        name = f"{stamp}-{n}"
    target = head
    if status_porcelain(tree):
        fd, idx = tempfile.mkstemp(prefix="afd-index-")
        os.close(fd)
        try:
            real_index = tree / ".git" / "index"
            if real_index.exists():
                shutil.copyfile(real_index, idx)
            env = {"GIT_INDEX_FILE": idx}
            run_git(tree, "add", "-A", ".", env_extra=env)
            tree_id = git(tree, "write-tree", env_extra=env)
            target = git(tree, "commit-tree", tree_id, "-p", head, "-m",
                         f"afd: uncommitted changes saved before {reason}", fixed_identity=True)
        finally:
            os.unlink(idx)
    run_git(tree, "branch", name, target)
    return name


def tree_problems(tree: Path, state: dict | None) -> list[str]:
    """Reasons why rebuilding would lose work (empty = safe)."""
    problems = []
    head = rev_parse(tree, "HEAD")
    dirty = status_porcelain(tree)
    am = am_in_progress(tree)
    if dirty:
        shown = dirty[:20] + ([f"... and {len(dirty) - 20} more"] if len(dirty) > 20 else [])
        problems.append("uncommitted changes (untracked files included):\n      "
                        + "\n      ".join(shown))
    recorded = state.get("head") if state else None
    if head != recorded:
        if recorded and rev_parse(tree, recorded) and run_git(
            tree, "merge-base", "--is-ancestor", recorded, "HEAD", check=False
        ).returncode == 0:
            log_lines = git(tree, "log", "--oneline", "--no-decorate", f"{recorded}..HEAD")
            problems.append("commits not exported yet:\n      "
                            + "\n      ".join(log_lines.splitlines()[:20]))
        else:
            problems.append(f"HEAD ({(head or 'none')[:12]}) is not the commit afdtool recorded "
                            f"({(recorded or 'none')[:12]}): history was rewritten or reset")
    if am and not (state and state.get("status") == "failed" and head == recorded and not dirty):
        problems.append("a `git am` is in progress (see `git am --show-current-patch`)")
    return problems


# ---------------------------------------------------------------- the command


def build(repo: Target, tree: Path, source: str | None = None, force: bool = False,
          quiet: bool = False) -> dict:
    """Bring tree up to date with repo's inputs. Returns the recorded state."""
    t0 = time.monotonic()
    series = read_series(repo)
    patches = require_clean_series(repo, series)
    fp = inputs_fingerprint(repo, source)
    state = None
    if tree.exists() and any(tree.iterdir()):
        if not (tree / ".git").is_dir() or not rev_parse(tree, BASE_TAG):
            raise AfdError(f"{tree} exists but is not a tree made by afdtool (no {BASE_TAG} tag); "
                           "move it away or choose another --tree")
        state = read_state(tree)
        if (state and state.get("inputs") == fp and state.get("status") == "ok"
                and rev_parse(tree, "HEAD") == state.get("head") and not am_in_progress(tree)
                and not status_porcelain(tree)):
            if not quiet:
                print(f"{tree}: up to date ({len(patches)} patches, "
                      f"{time.monotonic() - t0:.2f}s)")
            return state
        problems = tree_problems(tree, state)
        if problems:
            if not force:
                raise AfdError(
                    f"{tree} has work that a rebuild would lose:\n  - " + "\n  - ".join(problems)
                    + "\nCommit it and run `make export-patches` first, or re-run with --force "
                    "(`make apply-patches APPLY_ARGS=--force`) to save it on a backup branch and rebuild."
                )
            branch = _backup(tree, "apply --force")
            print(f"saved the previous state of {tree} on branch {branch}")
    pristine, archive_sha = prepare_base(repo, source)
    if state is None and not (tree / ".git").is_dir():
        if tree.exists():
            tree.rmdir()
        init_tree(tree, pristine)
    else:
        if not state or state.get("archive_sha256") != archive_sha:
            update_base(tree, pristine)
        reset_to_base(tree)
    overlay = commit_overlay(tree, repo)
    common = dict(format=1, inputs=fp, archive_sha256=archive_sha, source=source or "",
                  series=[p.name for p in patches], overlay=overlay)
    try:
        am_series(tree, patches)
    except PatchFailed as exc:
        write_state(tree, **common, status="failed", head=rev_parse(tree, "HEAD"))
        raise AfdError(
            f"{exc}\nThe tree is left in the `git am` state at that patch. Next step, either:\n"
            f"  - fix patches/{exc.patch.name} and re-run `make apply-patches`, or\n"
            f"  - resolve it in the tree: cd {tree} && git am --show-current-patch=diff; edit the "
            f"files; git add -A; git am --continue (applies the rest); then "
            f"`make export-patches`.\n  (`git am --abort` returns to the last good patch.)"
        ) from None
    state = dict(common, status="ok", head=rev_parse(tree, "HEAD"), by="apply")
    write_state(tree, **state)
    if not quiet:
        print(f"applied overlay ({len(overlay)} files) + {len(patches)} patches -> {tree} "
              f"(HEAD {state['head'][:12]}, {time.monotonic() - t0:.1f}s)")
    return state


def add_arguments(parser) -> None:
    parser.add_argument("--source", help="where to get the sdist (see `afdtool fetch --help`)")
    parser.add_argument("--force", action="store_true",
                        help="save uncommitted/unexported work on branch afd/backup-<time>, "
                        "then rebuild")


def run(args) -> int:
    build(args.target, args.target.tree, source=args.source, force=args.force)
    return 0
