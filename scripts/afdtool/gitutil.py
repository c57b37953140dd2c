"""Run git with an isolated, deterministic configuration.

Every call gets GIT_CONFIG_GLOBAL=/dev/null and GIT_CONFIG_NOSYSTEM=1 so that the user's
configuration cannot change results (am.threeWay, format.*, diff.* ...), LC_ALL=C so that
messages are parseable, and a fixed identity for the commits afdtool itself creates.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .errors import AfdError

FIXED_NAME = "vLLM-AFD tooling"
FIXED_EMAIL = "afd-tooling@localhost"
FIXED_DATE = "2000-01-01T00:00:00+0000"


def git_env(fixed_identity: bool = False, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        # GIT_DIR & co. from an outer hook or shell must not redirect our calls.
        if key in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_CONFIG", "GIT_CEILING_DIRECTORIES"):
            del env[key]
    env.update(
        GIT_CONFIG_GLOBAL="/dev/null",
        GIT_CONFIG_NOSYSTEM="1",
        LC_ALL="C",
        LANGUAGE="C",
        GIT_TERMINAL_PROMPT="0",
        GIT_PAGER="cat",
        PAGER="cat",
    )
    # Committer identity is always fixed (git am keeps the patch's author).
    env.setdefault("GIT_COMMITTER_NAME", FIXED_NAME)
    env.setdefault("GIT_COMMITTER_EMAIL", FIXED_EMAIL)
    if fixed_identity:
        env.update(
            GIT_AUTHOR_NAME=FIXED_NAME,
            GIT_AUTHOR_EMAIL=FIXED_EMAIL,
            GIT_AUTHOR_DATE=FIXED_DATE,
            GIT_COMMITTER_NAME=FIXED_NAME,
            GIT_COMMITTER_EMAIL=FIXED_EMAIL,
            GIT_COMMITTER_DATE=FIXED_DATE,
        )
    if extra:
        env.update(extra)
    return env


def run_git(
    cwd: Path | str | None,
    *args: str,
    check: bool = True,
    input: bytes | None = None,
    fixed_identity: bool = False,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    cmd = ["git", *args]
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        input=input,
        capture_output=True,
        env=git_env(fixed_identity, env_extra),
    )
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip() or proc.stdout.decode(errors="replace")
        raise AfdError(f"`git {' '.join(args[:3])}` failed in {cwd}:\n{err.strip()}")
    return proc


def git(cwd: Path | str | None, *args: str, **kw) -> str:
    """Run git and return stdout as text (stripped of the final newline)."""
    return run_git(cwd, *args, **kw).stdout.decode(errors="surrogateescape").rstrip("\n")


def git_ok(cwd: Path | str | None, *args: str) -> bool:
    return run_git(cwd, *args, check=False).returncode == 0


def rev_parse(cwd: Path | str, rev: str) -> str | None:
    proc = run_git(cwd, "rev-parse", "-q", "--verify", rev + "^{commit}", check=False)
    return proc.stdout.decode().strip() if proc.returncode == 0 else None


def is_git_repo(path: Path) -> bool:
    return (path / ".git").exists()


def status_porcelain(cwd: Path | str, *paths: str) -> list[str]:
    """Uncommitted changes, untracked files included (ignored files are not user work)."""
    args = ["status", "--porcelain=v1", "--untracked-files=all", "--ignore-submodules=none"]
    if paths:
        args += ["--", *paths]
    out = run_git(cwd, *args).stdout.decode(errors="surrogateescape")
    return [line for line in out.splitlines() if line.strip()]


def ls_tree_files(cwd: Path | str, rev: str) -> dict[str, str]:
    """path -> mode for every blob/link in rev's tree."""
    out = run_git(cwd, "ls-tree", "-r", "-z", "--full-tree", rev).stdout.decode(
        errors="surrogateescape"
    )
    result = {}
    for entry in out.split("\0"):
        if not entry:
            continue
        meta, path = entry.split("\t", 1)
        mode = meta.split()[0]
        result[path] = mode
    return result


def am_in_progress(tree: Path) -> bool:
    return (tree / ".git" / "rebase-apply").is_dir()
