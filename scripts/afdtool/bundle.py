"""Offline install bundle for the air-gapped GPU host -> dist/bundle/.

Contents of the bundle directory:
  part-000, part-001, ...   one tar (payload/wheels/*.whl, payload/deps/*.whl, payload/DROPPED.txt)
                            split into parts of at most 48 MiB
  MANIFEST.sha256           sha256 of every part (`sha256sum -c` format)
  bundle.tar.sha256         sha256 of the joined tar
  install.sh                checks, joins, unpacks, `pip install --no-index --no-deps --target`

With --hopper-only (default) the custom CUDA wheel is repacked without the pre-Hopper FA2
kernels, the vllm-rs binary and the deep_gemm extensions of other Python versions (listed in
DROPPED.txt). Dependency wheels come from scripts/gpu_host_deps.txt (the verified set for the
host), minus what --host-freeze says is already installed at that version.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from afdtool.errors import AfdError
from afdtool.fetch import sha256_file
from afdtool.pin import REPO_ROOT, cache_dir
from afdtool.wheel import (
    Member,
    expected_wheel_path,
    mode_of,
    order_members,
    write_zip,
)

PART_SIZE = 48 * 1024 * 1024
# manylinux up to 2_35 (the host runs Python 3.12.3 on a glibc >= 2.35 distribution) and every
# older tag: pip does not widen --platform by itself (llguidance 1.7.6 is manylinux_2_31)
PLATFORM_ARGS = [
    a
    for tag in [f"manylinux_2_{m}_x86_64" for m in range(35, 4, -1)]
    + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    for a in ("--platform", tag)
]
DEPS_FILE = REPO_ROOT / "scripts" / "gpu_host_deps.txt"
INSTALL_SH = REPO_ROOT / "scripts" / "gpu_install.sh"


# --------------------------------------------------------------------------------------------
# split / join / manifest


def split_file(path: Path, out_dir: Path, part_size: int = PART_SIZE) -> list[Path]:
    parts = []
    with open(path, "rb") as f:
        i = 0
        while True:
            data = f.read(part_size)
            if not data and i:
                break
            part = out_dir / f"part-{i:03d}"
            part.write_bytes(data)
            parts.append(part)
            i += 1
            if len(data) < part_size:
                break
    return parts


def write_manifest(out_dir: Path, files: list[Path]) -> Path:
    manifest = out_dir / "MANIFEST.sha256"
    manifest.write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in sorted(files)))
    return manifest


def verify_and_join(bundle_dir: Path, dest: Path) -> Path:
    """What install.sh does, in Python: check every part, join them in order."""
    entries = []
    for line in (bundle_dir / "MANIFEST.sha256").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        if sha256_file(bundle_dir / name) != digest:
            raise AfdError(f"{name}: sha256 mismatch")
        entries.append(name)
    with open(dest, "wb") as out:
        for name in sorted(n for n in entries if n.startswith("part-")):
            out.write((bundle_dir / name).read_bytes())
    digest, _ = (bundle_dir / "bundle.tar.sha256").read_text().split(maxsplit=1)
    if sha256_file(dest) != digest:
        raise AfdError("joined tar: sha256 mismatch")
    return dest


# --------------------------------------------------------------------------------------------
# hopper-only wheel


def hopper_drop(name: str, python: str) -> bool:
    tag = "cpython-" + python.replace(".", "")
    if name in ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"):
        return True
    if name.startswith("vllm/third_party/deep_gemm/") and re.search(r"\.cpython-\d+-", name):
        return tag + "-" not in name
    return False


def slim_wheel(src: Path, dest: Path, python: str) -> list[str]:
    """Copy the wheel without the files hopper_drop() names; RECORD rows of kept files kept."""
    with zipfile.ZipFile(src) as z:
        infos = [i for i in z.infolist() if not i.filename.endswith("/")]
        (record_name,) = [i.filename for i in infos if i.filename.endswith(".dist-info/RECORD")]
        dropped = [i.filename for i in infos if hopper_drop(i.filename, python)]
        members = [
            Member(i.filename, mode_of(i), src=i)
            for i in infos
            if i.filename not in dropped and i.filename != record_name
        ]
        rows = list(csv.reader(io.StringIO(z.read(record_name).decode())))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in rows:
        if row and row[0] not in dropped:
            w.writerow(row)
    members = order_members(members)
    members.append(Member(record_name, 0o644, data=buf.getvalue().encode()))
    write_zip(dest, members, src_path=src)
    return dropped


# --------------------------------------------------------------------------------------------
# dependency wheels


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: Path) -> list[tuple[str, str]]:
    reqs = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise AfdError(f"{path}: expected name==version, got {raw!r}")
        reqs.append((name.strip(), version.strip()))
    return reqs


def read_freeze(path: Path) -> dict[str, str]:
    installed = {}
    for raw in path.read_text().splitlines():
        name, sep, version = raw.strip().partition("==")
        if sep:
            installed[_norm(name)] = version.strip()
    return installed


def needed_deps(reqs: list[tuple[str, str]], freeze: dict[str, str]) -> list[tuple[str, str]]:
    return [(n, v) for n, v in reqs if freeze.get(_norm(n)) != v]


def download_deps(reqs: list[tuple[str, str]], dest: Path, python: str) -> list[Path]:
    """pip download the exact wheels for the host (cached in cache_dir()/bundle-deps)."""
    cache = cache_dir() / f"bundle-deps-cp{python.replace('.', '')}"
    cache.mkdir(parents=True, exist_ok=True)
    abi = "cp" + python.replace(".", "")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--python-version", python,
        *PLATFORM_ARGS, "--implementation", "cp", "--abi", abi,
        "--abi", "abi3", "--abi", "none", "-d", str(cache),
        *[f"{n}=={v}" for n, v in reqs],
    ]  # fmt: skip
    print(f"pip download {len(reqs)} dependency wheels for cp{abi[2:]} -> {cache}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise AfdError(f"pip download failed:\n{tail}")
    files = []
    by_key = {}
    for whl in cache.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        by_key[(_norm(name), version)] = whl
    for n, v in reqs:
        whl = by_key.get((_norm(n), v))
        if whl is None:
            raise AfdError(f"{n}=={v}: no wheel downloaded")
        shutil.copy2(whl, dest / whl.name)
        files.append(dest / whl.name)
    return files


# --------------------------------------------------------------------------------------------


def _tar_add(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    info = tar.gettarinfo(str(path), arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o644
    with open(path, "rb") as f:
        tar.addfile(info, f)


def make_bundle(
    wheel: Path,
    out: Path,
    *,
    python: str = "3.12",
    hopper_only: bool = True,
    deps: list[tuple[str, str]] | None = None,
    part_size: int = PART_SIZE,
    install_sh: Path = INSTALL_SH,
) -> list[Path]:
    if not wheel.is_file():
        raise AfdError(f"CUDA wheel {wheel} is missing; run `make wheel`")
    if out.exists():
        shutil.rmtree(out)
    stage = out.parent / (out.name + ".stage")
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "payload" / "wheels").mkdir(parents=True)
    (stage / "payload" / "deps").mkdir(parents=True)
    out.mkdir(parents=True)
    dropped: list[str] = []
    target = stage / "payload" / "wheels" / wheel.name
    if hopper_only:
        dropped = slim_wheel(wheel, target, python)
        print(f"hopper-only wheel: dropped {len(dropped)} files: {', '.join(dropped)}")
    else:
        shutil.copy2(wheel, target)
    (stage / "payload" / "DROPPED.txt").write_text("".join(d + "\n" for d in dropped))
    dep_files = download_deps(deps, stage / "payload" / "deps", python) if deps else []

    tar_path = stage / "bundle.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        files = [target, stage / "payload" / "DROPPED.txt", *sorted(dep_files)]
        for f in files:
            _tar_add(tar, f, f.relative_to(stage).as_posix())
    parts = split_file(tar_path, out, part_size)
    (out / "bundle.tar.sha256").write_text(f"{sha256_file(tar_path)}  bundle.tar\n")
    write_manifest(out, parts)
    shutil.copy2(install_sh, out / "install.sh")
    (out / "install.sh").chmod(0o755)
    shutil.rmtree(stage)
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wheel", default=None, help="custom CUDA wheel (default: dist/ one)")
    parser.add_argument("--dist", default=str(REPO_ROOT / "dist"))
    parser.add_argument("--out", default=str(REPO_ROOT / "dist" / "bundle"))
    parser.add_argument("--python", default="3.12", help="the host's Python (X.Y)")
    parser.add_argument("--host-freeze", default=None, help="`pip freeze` of the host")
    parser.add_argument("--deps-file", default=None, help="the dependency wheels to carry "
                        "(default: the target's targets/X/gpu_host_deps.txt, else "
                        "scripts/gpu_host_deps.txt)")
    parser.add_argument("--no-deps", action="store_true", help="bundle the vLLM wheel only")
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--hopper-only", dest="hopper_only", action="store_true", default=True)
    g.add_argument("--all-archs", dest="hopper_only", action="store_false")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    wheel = (Path(args.wheel) if args.wheel
             else expected_wheel_path("cuda", Path(args.dist), args.target))
    if not wheel.is_file():
        raise AfdError(f"custom CUDA wheel {wheel} of {args.target.describe()} is missing; run "
                       f"`make wheel{'' if args.target.primary else ' VLLM_VERSION=' + args.target.version}`")
    deps = None
    if not args.no_deps:
        deps_file = Path(args.deps_file) if args.deps_file else args.target.gpu_deps_file
        deps = read_requirements(deps_file)
        print(f"dependency wheels: {len(deps)} from {deps_file}")
        if args.host_freeze:
            before = len(deps)
            deps = needed_deps(deps, read_freeze(Path(args.host_freeze)))
            print(f"--host-freeze: {before - len(deps)} of {before} already on the host")
    parts = make_bundle(
        wheel, Path(args.out), python=args.python, hopper_only=args.hopper_only, deps=deps
    )
    total = sum(p.stat().st_size for p in parts)
    print(
        f"bundle {args.out}: {total / 2**20:.1f} MiB in {len(parts)} parts "
        f"[{time.monotonic() - t0:.1f}s]"
    )
    for p in parts:
        print(f"  {p.name}  {p.stat().st_size / 2**20:.1f} MiB")
    print(f"on the host: copy {args.out}/ over and run ./install.sh TARGET_DIR")
    return 0
