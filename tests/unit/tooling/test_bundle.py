"""afdtool bundle: split / manifest / join, install.sh, hopper-only slimming, host-freeze."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from afdtool import bundle as B

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("size", [0, 1, 1000, 1024, 3000])
def test_split_join_roundtrip(tmp_path, size):
    data = os.urandom(size)
    src = tmp_path / "bundle.tar"
    src.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    parts = B.split_file(src, out, part_size=1024)
    assert all(p.stat().st_size <= 1024 for p in parts)
    assert len(parts) == max(1, -(-size // 1024))
    (out / "bundle.tar.sha256").write_text(f"{B.sha256_file(src)}  bundle.tar\n")
    B.write_manifest(out, parts)
    assert B.verify_and_join(out, tmp_path / "joined").read_bytes() == data
    if parts and size:
        parts[-1].write_bytes(parts[-1].read_bytes()[:-1] + b"\0")
        if parts[-1].read_bytes() != data[-len(parts[-1].read_bytes()) :]:
            with pytest.raises(B.AfdError, match="sha256"):
                B.verify_and_join(out, tmp_path / "joined2")


def _wheel(path: Path) -> None:
    di = "vllm-0.26.0+afd.x.dist-info"
    names = [
        "vllm/__init__.py",
        "vllm/vllm-rs",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
        f"{di}/METADATA",
    ]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n in names:
            z.writestr(n, n.encode())
        z.writestr(
            f"{di}/RECORD", "".join(f"{n},sha256=x,{len(n)}\n" for n in names) + f"{di}/RECORD,,\n"
        )


def test_bundle_and_install_sh(tmp_path):
    whl = tmp_path / "vllm-0.26.0+afd.x-cp38-abi3-manylinux_2_28_x86_64.whl"
    _wheel(whl)
    out = tmp_path / "bundle"
    parts = B.make_bundle(whl, out, python="3.12", hopper_only=True, deps=None, part_size=700)
    assert len(parts) > 1 and all(p.stat().st_size <= 700 for p in parts)
    assert (out / "install.sh").stat().st_mode & 0o111
    joined = B.verify_and_join(out, tmp_path / "b.tar")
    import tarfile

    with tarfile.open(joined) as tar:
        names = tar.getnames()
        slim = tar.extractfile(f"payload/wheels/{whl.name}").read()
        dropped = tar.extractfile("payload/DROPPED.txt").read().decode().split()
    assert sorted(dropped) == [
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
        "vllm/vllm-rs",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    ]
    assert "payload/DROPPED.txt" in names
    (tmp_path / "slim.whl").write_bytes(slim)
    with zipfile.ZipFile(tmp_path / "slim.whl") as z:
        kept = set(z.namelist())
        record = z.read("vllm-0.26.0+afd.x.dist-info/RECORD").decode()
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in kept and not kept & set(dropped)
    assert not any(d in record for d in dropped)

    # install.sh: a corrupted part is refused before anything is installed
    p = out / "part-001"
    p.write_bytes(b"x" + p.read_bytes()[1:])
    proc = subprocess.run(
        ["bash", str(out / "install.sh"), str(tmp_path / "site")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and not (tmp_path / "site").exists()


def _wheel_with_pth(path: Path) -> None:
    """An installable wheel whose module ``hidden`` is reachable only through its .pth file,
    as the CuTe DSL's ``cutlass`` is (nvidia_cutlass_dsl_packages.pth)."""
    di = "vllm-0.26.0+afd.x.dist-info"
    files = {
        "hidden_root/__init__.py": "",
        "hidden_root/inner/hidden.py": "VALUE = 42\n",
        "hidden_root.pth": "import sys, os, hidden_root; "
        "sys.path.insert(0, os.path.join(hidden_root.__path__[0], 'inner'))\n",
        f"{di}/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0+afd.x\n",
        f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: cp38-abi3-manylinux_2_28_x86_64\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{di}/RECORD", "".join(f"{n},,\n" for n in files) + f"{di}/RECORD,,\n")


def test_install_sh_puts_the_folders_of_pth_files_on_pythonpath(tmp_path):
    """pip --target does not run .pth files: install.sh's afd-env.sh adds their folders
    (on the H200, vLLM 0.34.0 ended on "No module named 'cutlass'" without them)."""
    whl = tmp_path / "vllm-0.26.0+afd.x-cp38-abi3-manylinux_2_28_x86_64.whl"
    _wheel_with_pth(whl)
    out = tmp_path / "bundle"
    B.make_bundle(whl, out, python="3.12", hopper_only=False, deps=None)
    site = tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ""}
    proc = subprocess.run(["bash", str(out / "install.sh"), str(site)], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"source {site}/afd-env.sh" in proc.stdout
    probe = [sys.executable, "-c", "import hidden; print(hidden.VALUE)"]
    bare = subprocess.run(probe, capture_output=True, text=True, env={**env, "PYTHONPATH": str(site)})
    assert bare.returncode != 0 and "No module named 'hidden'" in bare.stderr
    sourced = subprocess.run(["bash", "-c", f'source "{site}/afd-env.sh" && "$@"', "-", *probe],
                             capture_output=True, text=True, env=env)  # fmt: skip
    assert sourced.returncode == 0 and sourced.stdout.strip() == "42", sourced.stderr
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in (site / "afd-env.sh").read_text()


def test_host_freeze_filter(tmp_path):
    reqs = B.read_requirements(B.DEPS_FILE)
    assert ("lark", "1.2.2") in reqs and len(reqs) > 50
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("Lark==1.2.2\npydantic==2.0.0\n")
    need = B.needed_deps(reqs, B.read_freeze(freeze))
    assert ("lark", "1.2.2") not in need and ("pydantic", "2.14.4") in need


def test_each_target_bundles_its_own_dependency_list():
    """A line whose torch differs from the GPU host's carries it: the target's own list
    (targets/X/gpu_host_deps.txt) names torch, triton and NCCL at the versions its vLLM needs;
    a target without one, and the primary pin, use scripts/gpu_host_deps.txt (no torch)."""
    from afdtool import targets

    primary = targets.resolve()
    assert primary.gpu_deps_file == B.DEPS_FILE
    assert "torch" not in dict(B.read_requirements(primary.gpu_deps_file))
    assert targets.resolve(version="0.32.0").gpu_deps_file == B.DEPS_FILE
    t34 = targets.resolve(version="0.34.0")
    assert t34.gpu_deps_file == targets.target_dir(None, "0.34.0") / "gpu_host_deps.txt"
    deps = dict(B.read_requirements(t34.gpu_deps_file))
    assert deps["torch"] == t34.pin.get("TORCH") == "2.14.0"
    assert deps["triton"].startswith("3.8.") and deps["nvidia-nccl-cu13"] == "2.32.6"
