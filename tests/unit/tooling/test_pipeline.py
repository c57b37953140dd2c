"""apply / export / check on a synthetic upstream, plus the real pinned source when cached."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_lib import TRAILERS, git, trailers

from afdtool.targets import resolve


def state_head(afd) -> str:
    return git(afd.tree, "rev-parse", "HEAD").strip()


def test_apply_builds_base_overlay_series(warm, capsys):
    assert warm.run("apply") == 0
    out = capsys.readouterr().out
    assert "0 patches" in out
    log = git(warm.tree, "log", "--format=%s%d")
    assert "AFD overlay (HEAD -> main, tag: afd/overlay)" in log
    assert "upstream vLLM 9.9.0 (tag: afd/base)" in log
    assert (warm.tree / "vllm" / "afd" / "__init__.py").read_text() == "AFD = True\n"
    assert (warm.tree / "vllm" / "engine.py").is_file()
    # no owner from the archive (uid 4242), so git does not complain about ownership
    assert (warm.tree / "vllm" / "engine.py").stat().st_uid == os.getuid()
    assert git(warm.tree, "status", "--porcelain") == ""


def test_reapply_is_noop_and_fast(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3")
    capsys.readouterr()
    head = state_head(warm)
    t0 = time.monotonic()
    assert warm.run("apply") == 0
    assert time.monotonic() - t0 < 10
    assert "up to date" in capsys.readouterr().out
    assert state_head(warm) == head


def test_export_round_trip_is_byte_identical(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "[AFD] Change f3")
    warm.add_patch("vllm/config/__init__.py", "X = 1\n", "X = 2\n", "Change X")
    names = (warm.repo / "patches" / "series").read_text().splitlines()
    assert names == ["# test series", "# second header line",
                     "0001-AFD-Change-f3.patch", "0002-Change-X.patch"]
    before = {p.name: p.read_bytes() for p in (warm.repo / "patches").iterdir()}
    assert b"Subject: [AFD] Change f3" in before["0001-AFD-Change-f3.patch"]
    # rebuild from scratch, then export again: same bytes, clean outer repo
    shutil.rmtree(warm.tree)
    assert warm.run("apply") == 0
    capsys.readouterr()
    assert warm.run("export") == 0
    assert "nothing changed" in capsys.readouterr().out
    after = {p.name: p.read_bytes() for p in (warm.repo / "patches").iterdir()}
    assert after == before
    assert git(warm.repo, "status", "--porcelain") == ""
    assert warm.run("apply") == 0
    assert "up to date" in capsys.readouterr().out


def test_check_passes(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3")
    capsys.readouterr()
    assert warm.run("check") == 0
    out = capsys.readouterr().out
    assert "check: PASS" in out and "FAIL" not in out


def test_fuzz_needed_is_rejected_with_patch_file_hunk(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 7\n", "return 77\n", "Change f7")
    patch = warm.repo / "patches" / "0001-Change-f7.patch"
    text = patch.read_text()
    # Break one context line: git would need fuzz to apply this hunk.
    patch.write_text(text.replace(" def f7():", " def f7(): # moved", 1))
    capsys.readouterr()
    assert warm.run("apply") == 1
    err = capsys.readouterr().err
    assert "patch 0001-Change-f7.patch (1 of 1) does not apply strictly" in err
    assert "file vllm/engine.py, hunk #1 of 1: @@ -" in err
    assert "git am --continue" in err and "git am --abort" in err
    assert (warm.tree / ".git" / "rebase-apply").is_dir()  # left for inspection
    # fixing the patch file and re-running rebuilds without --force
    patch.write_text(text)
    assert warm.run("apply") == 0
    assert "return 77" in (warm.tree / "vllm" / "engine.py").read_text()
    # check also reports it
    patch.write_text(text.replace(" def f7():", " def f7(): # moved", 1))
    capsys.readouterr()
    assert warm.run("check") == 1
    out = capsys.readouterr().out
    assert "FAIL  overlay + 1 patches apply strictly" in out and "hunk #1" in out


@pytest.mark.parametrize("problem", ["missing", "unused", "duplicate"])
def test_series_mismatch(warm, capsys, problem):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3")
    series = warm.repo / "patches" / "series"
    name = "0001-Change-f3.patch"
    if problem == "missing":
        series.write_text(series.read_text() + "0002-gone.patch\n")
        expect = "0002-gone.patch is listed but patches/0002-gone.patch is missing"
    elif problem == "unused":
        shutil.copy(warm.repo / "patches" / name, warm.repo / "patches" / "stray.patch")
        expect = "patches/stray.patch is not listed in series"
    else:
        series.write_text(series.read_text() + name + "\n")
        expect = f"duplicate entry {name}"
    capsys.readouterr()
    assert warm.run("check") == 1
    out = capsys.readouterr().out
    assert "FAIL  series lists exactly" in out and expect in out
    if problem != "unused":
        assert warm.run("apply") == 1
        assert expect in capsys.readouterr().err


def test_missing_trailer(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3",
                   trailers=TRAILERS.replace("Removal: never\n", "")
                   .replace("Inappropriate [AFD only]", "Not-yet"))
    capsys.readouterr()
    assert warm.run("check") == 1
    out = capsys.readouterr().out
    assert "missing trailer `Removal:`" in out
    assert "missing trailer `Patch-Id:`" in out
    assert "Upstream-Status 'Not-yet' must be one of Pending, Submitted [where]" in out


@pytest.mark.parametrize("status, forwarded, problem", [
    ("Pending", "not-needed", "Upstream-Status Pending goes with `Forwarded: no`"),
    ("Inappropriate [AFD only]", "no", "Inappropriate goes with `Forwarded: not-needed`"),
    ("Submitted [upstream]", "no", "Upstream-Status Submitted needs `Forwarded:` to say where"),
    ("Submitted", "vllm-project/vllm#1", "Upstream-Status 'Submitted' must be one of"),
    ("Accepted", "vllm-project/vllm#1", None),
])
def test_upstream_status_and_forwarded_agree(warm, capsys, status, forwarded, problem):
    rest = (TRAILERS.replace("Inappropriate [AFD only]", status)
            .replace("Forwarded: not-needed", f"Forwarded: {forwarded}"))
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3",
                   trailers=trailers("Change f3", rest))
    capsys.readouterr()
    out_rc = warm.run("check")
    out = capsys.readouterr().out
    if problem is None:
        assert out_rc == 0, out
    else:
        assert out_rc == 1 and problem in out, out


def test_patch_ids_unique_in_a_series(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3",
                   trailers=trailers("same id"))
    warm.add_patch("vllm/engine.py", "return 7\n", "return 77\n", "Change f7",
                   trailers=trailers("same id"))
    capsys.readouterr()
    assert warm.run("check") == 1
    out = capsys.readouterr().out
    assert "Patch-Id 'same-id' is taken by 0001-Change-f3.patch" in out


def test_overlay_shadowing_upstream_is_refused(warm, capsys):
    (warm.repo / "overlay" / "vllm" / "engine.py").write_text("shadow\n")
    assert warm.run("apply") == 1
    err = capsys.readouterr().err
    assert "overlay/vllm/engine.py would replace the upstream file vllm/engine.py" in err


def test_export_moves_overlay_changes_and_splits_mixed_commits(warm, capsys):
    assert warm.run("apply") == 0
    (warm.tree / "vllm" / "afd" / "__init__.py").write_text("AFD = 2\n")
    (warm.tree / "vllm" / "afd" / "new.py").write_text("NEW = 1\n")
    text = (warm.tree / "vllm" / "engine.py").read_text().replace("return 1\n", "return 11\n")
    warm.commit_in_tree("vllm/engine.py", text, f"Mixed\n\n{trailers('Mixed')}")
    warm.commit_in_tree("vllm/afd/other.py", "O = 1\n", "Only overlay")
    capsys.readouterr()
    assert warm.run("export") == 0
    out = capsys.readouterr().out
    assert "split" in out and "touches only overlay files -> no patch" in out
    assert (warm.repo / "overlay" / "vllm" / "afd" / "__init__.py").read_text() == "AFD = 2\n"
    assert (warm.repo / "overlay" / "vllm" / "afd" / "other.py").read_text() == "O = 1\n"
    patch = (warm.repo / "patches" / "0001-Mixed.patch").read_text()
    assert "vllm/engine.py" in patch and "vllm/afd" not in patch
    assert sorted(p.name for p in (warm.repo / "patches").iterdir()) == [
        "0001-Mixed.patch", "series"]
    assert warm.run("apply") == 0 and "up to date" in capsys.readouterr().out
    assert warm.run("export") == 0 and "nothing changed" in capsys.readouterr().out
    git(warm.repo, "add", "-A")
    git(warm.repo, "commit", "-q", "-m", "export")
    assert warm.run("check") == 0
    # deleting an overlay file in the tree deletes it from overlay/
    git(warm.tree, "rm", "-q", "vllm/afd/other.py")
    git(warm.tree, "commit", "-q", "-m", "drop other")
    assert warm.run("export") == 0
    assert not (warm.repo / "overlay" / "vllm" / "afd" / "other.py").exists()


def test_dirty_tree_refused_then_force_backs_up(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3")
    warm.commit_in_tree("vllm/config/__init__.py", "X = 5\n", "unexported commit")
    (warm.tree / "vllm" / "engine.py").write_text("my edit\n")
    (warm.tree / "notes.txt").write_text("untracked work\n")
    # change the inputs so a rebuild is needed
    (warm.repo / "overlay" / "vllm" / "afd" / "__init__.py").write_text("AFD = 3\n")
    capsys.readouterr()
    assert warm.run("apply") == 1
    err = capsys.readouterr().err
    assert "uncommitted changes" in err and "vllm/engine.py" in err and "notes.txt" in err
    assert "commits not exported yet" in err and "unexported commit" in err
    assert "--force" in err
    assert (warm.tree / "vllm" / "engine.py").read_text() == "my edit\n"
    assert (warm.tree / "notes.txt").read_text() == "untracked work\n"
    # export refuses too (uncommitted changes)
    assert warm.run("export") == 1
    assert "uncommitted changes" in capsys.readouterr().err
    assert warm.run("apply", "--force") == 0
    out = capsys.readouterr().out
    branch = out.split("on branch ", 1)[1].split()[0]
    assert branch.startswith("afd/backup-")
    assert git(warm.tree, "show", f"{branch}:notes.txt") == "untracked work\n"
    assert git(warm.tree, "show", f"{branch}:vllm/engine.py") == "my edit\n"
    assert "unexported commit" in git(warm.tree, "log", "--format=%s", branch)
    assert "return 33" in (warm.tree / "vllm" / "engine.py").read_text()
    assert not (warm.tree / "notes.txt").exists()


def test_export_refuses_dirty_outer_repo(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3")
    patch = warm.repo / "patches" / "0001-Change-f3.patch"
    patch.write_text(patch.read_text() + "\n")  # uncommitted edit in patches/
    warm.commit_in_tree("vllm/config/__init__.py", "X = 5\n", "more")
    capsys.readouterr()
    assert warm.run("export") == 1
    err = capsys.readouterr().err
    assert "changed since" in err  # the outer edit was never applied to the tree
    assert patch.read_text().endswith("\n\n")


def test_corrupt_archive_refused_by_apply(afd, capsys):
    afd.cache.mkdir()
    (afd.cache / afd.sdist.name).write_bytes(b"broken")
    assert afd.run("apply") == 1
    assert "wrong sha256" in capsys.readouterr().err
    assert not afd.tree.exists()


def test_cli_subprocess(warm):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3] / "scripts"))
    proc = subprocess.run([sys.executable, "-m", "afdtool", "apply"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (warm.repo / "overlay" / "vllm" / "engine.py").write_text("x\n")
    proc = subprocess.run([sys.executable, "-m", "afdtool", "apply"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith("afdtool: error: ") and "Traceback" not in proc.stderr


REAL_ROOT = Path(__file__).resolve().parents[3]


def test_real_pinned_series(tmp_path, monkeypatch, capsys):
    for var in ("AFD_REPO_ROOT", "AFD_BUILD_TREE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AFD_INDEX_URL", "http://127.0.0.1:9/simple")
    repo = resolve(REAL_ROOT)
    from afdtool.pin import cache_dir

    if not (cache_dir() / repo.pin.get("SDIST")).is_file():
        pytest.fail(f"real sdist {repo.pin.get('SDIST')} is not in {cache_dir()}: run "
                    "`make fetch`", pytrace=False)
    from afdtool.apply import build
    from afdtool.check import check

    state = build(repo, tmp_path / "vllm")
    assert state["status"] == "ok"
    assert check(repo), capsys.readouterr().out


def test_resolve_failed_patch_in_tree_then_export(warm, capsys):
    warm.add_patch("vllm/engine.py", "return 7\n", "return 77\n", "Change f7")
    warm.add_patch("vllm/config/__init__.py", "X = 1\n", "X = 3\n", "Change X")
    # upstream moved: the first patch no longer applies strictly (simulated via its context)
    patch = warm.repo / "patches" / "0001-Change-f7.patch"
    patch.write_text(patch.read_text().replace(" def f7():", " def f7(): # moved", 1))
    git(warm.repo, "commit", "-q", "-am", "break")
    assert warm.run("apply") == 1
    capsys.readouterr()
    engine = warm.tree / "vllm" / "engine.py"
    engine.write_text(engine.read_text().replace("return 7\n", "return 77\n"))
    git(warm.tree, "add", "-A")
    git(warm.tree, "am", "--continue")  # applies the rest of the series too
    assert warm.run("export") == 0
    out = capsys.readouterr().out
    assert "updated patches/0001-Change-f7.patch" in out
    assert "0002-Change-X.patch" in (warm.repo / "patches" / "series").read_text()
    git(warm.repo, "commit", "-q", "-am", "fixed")
    assert warm.run("check") == 0
    assert warm.run("apply") == 0 and "up to date" in capsys.readouterr().out
