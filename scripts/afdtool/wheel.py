"""Build the custom vLLM wheels (CUDA and CPU) zip-to-zip from the upstream wheels.

The AFD series touches Python only, so the custom wheel is the upstream wheel of the pinned
release with:

* every compiled / non-.py file copied byte-identical (the compressed bytes are copied raw, so
  nothing is recompressed and a 300 MB wheel is rebuilt in seconds);
* each ``vllm/**`` file that the series changes or adds (``git diff afd/base HEAD -- vllm/`` in
  the patched tree) taken from the tree's HEAD; files the series deletes removed;
* ``vllm/_afd_revision.py`` added (AFD_REVISION, AFD_VLLM_VERSION, AFD_VARIANT);
* the ``.dist-info`` renamed to ``vllm-X.Y.Z+afd.<rev>[.cpu]``, METADATA's Name/Version rewritten
  (CPU: ``torch==X+cpu`` becomes ``torch==X``, marker kept), WHEEL's tag set to the file name's
  tag, and RECORD regenerated.

The output is reproducible: sorted entries, fixed timestamps (SOURCE_DATE_EPOCH, default
1980-01-02), fixed permissions (0644, or 0755 where upstream/git had an exec bit).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import struct
import subprocess
import time
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from afdtool.errors import AfdError
from afdtool.fetch import sha256_file
from afdtool.pin import REPO_ROOT, Pin, cache_dir
from afdtool.targets import Target

TAG = "cp38-abi3-manylinux_2_28_x86_64"
BASE_REF = "afd/base"
REVISION_MODULE = "vllm/_afd_revision.py"
# vLLM's version module: rewritten so that `vllm.__version__` names the AFD build.
VERSION_MODULE = "vllm/_version.py"
VARIANTS = ("cuda", "cpu")
_DEFAULT_EPOCH = 315_619_200  # 1980-01-02 00:00:00 UTC
_STAMP_SCHEMA = 1

# --------------------------------------------------------------------------------------------
# Reproducible zip writing with raw copy of unchanged members


def zip_datetime() -> tuple[int, int, int, int, int, int]:
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH") or _DEFAULT_EPOCH)
    epoch = max(epoch, _DEFAULT_EPOCH)
    t = time.gmtime(epoch)
    return (t.tm_year, t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec)


def _dos_time(dt: tuple[int, int, int, int, int, int]) -> tuple[int, int]:
    y, mo, d, h, mi, s = dt
    return ((y - 1980) << 9) | (mo << 5) | d, (h << 11) | (mi << 5) | (s // 2)


@dataclass
class Member:
    """One file of an output zip: either raw-copied from a source zip or new bytes."""

    name: str
    mode: int  # 0o644 or 0o755
    data: bytes | None = None  # new content (deflated on write)
    src: zipfile.ZipInfo | None = None  # raw copy of this member of the source zip

    def sha256_and_size(self, src_zip: zipfile.ZipFile | None) -> tuple[str, int]:
        if self.data is not None:
            digest, size = hashlib.sha256(self.data).digest(), len(self.data)
        else:
            assert src_zip is not None and self.src is not None
            h = hashlib.sha256()
            with src_zip.open(self.src) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            digest, size = h.digest(), self.src.file_size
        return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode(), size


def _raw_member_bytes(fh, info: zipfile.ZipInfo) -> Iterable[bytes]:
    """Yield the compressed bytes of a member, read straight from the archive file."""
    if info.flag_bits & 0x1:
        raise AfdError(f"{info.filename}: encrypted zip members are not supported")
    fh.seek(info.header_offset)
    header = fh.read(30)
    if header[:4] != b"PK\x03\x04":
        raise AfdError(f"{info.filename}: bad local file header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    fh.seek(info.header_offset + 30 + name_len + extra_len)
    left = info.compress_size
    while left:
        chunk = fh.read(min(left, 1 << 22))
        if not chunk:
            raise AfdError(f"{info.filename}: truncated member")
        left -= len(chunk)
        yield chunk


def write_zip(path: Path, members: list[Member], src_path: Path | None = None) -> None:
    """Write members in the given order; raw-copy members that come from src_path."""
    date, tod = _dos_time(zip_datetime())
    central = []
    tmp = path.with_name(path.name + ".tmp")
    src_fh = open(src_path, "rb") if src_path else None  # noqa: SIM115
    try:
        with open(tmp, "wb") as out:
            for m in members:
                name = m.name.encode("utf-8")
                flags = 0x800 if not m.name.isascii() else 0
                method, crc, csize, usize, chunks = _member_payload(m, src_fh)
                offset = out.tell()
                if max(offset, csize, usize) >= 0xFFFFFFFF:
                    raise AfdError(f"{m.name}: zip64 sizes are not supported")
                out.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, flags, method, tod,
                                      date, crc, csize, usize, len(name), 0))  # fmt: skip
                out.write(name)
                for chunk in chunks:
                    out.write(chunk)
                central.append((name, flags, method, crc, csize, usize, offset, m.mode))
            _write_central_directory(out, central, date, tod)
    finally:
        if src_fh:
            src_fh.close()
    os.replace(tmp, path)


def _member_payload(m: Member, src_fh) -> tuple[int, int, int, int, Iterable[bytes]]:
    """(method, crc, compressed size, size, chunks) of a member: its data deflated, or its
    bytes in the source zip (open as ``src_fh``) as they are."""
    if m.data is not None:
        co = zlib.compressobj(6, zlib.DEFLATED, -15)
        payload = co.compress(m.data) + co.flush()
        return 8, zlib.crc32(m.data), len(payload), len(m.data), [payload]
    assert m.src is not None and src_fh is not None
    info = m.src
    if info.compress_type not in (0, 8):
        raise AfdError(f"{info.filename}: unsupported compression {info.compress_type}")
    return (info.compress_type, info.CRC, info.compress_size, info.file_size,
            _raw_member_bytes(src_fh, info))  # fmt: skip


def _write_central_directory(out, central: list[tuple], date: int, tod: int) -> None:
    """The central directory of the members written so far, and the end record."""
    cd_start = out.tell()
    for name, flags, method, crc, csize, usize, offset, mode in central:
        made_by = (3 << 8) | 20  # unix, zip 2.0
        attrs = ((0o100000 | mode) << 16) & 0xFFFFFFFF
        out.write(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", made_by, 20, flags,
                              method, tod, date, crc, csize, usize, len(name), 0, 0, 0, 0,
                              attrs, offset))  # fmt: skip
        out.write(name)
    cd_size = out.tell() - cd_start
    if len(central) >= 0xFFFF:
        raise AfdError("too many zip members for a non-zip64 archive")
    out.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(central), len(central),
                          cd_size, cd_start, 0))  # fmt: skip


def record_bytes(members: list[Member], record_name: str, src_zip: zipfile.ZipFile | None) -> bytes:
    """RECORD as CSV (names with commas are quoted, like setuptools/wheel write them)."""
    buf = io.StringIO()
    writer = csv.writer(buf, delimiter=",", quotechar='"', lineterminator="\n")
    for m in members:
        digest, size = m.sha256_and_size(src_zip)
        writer.writerow((m.name, digest, size))
    writer.writerow((record_name, "", ""))
    return buf.getvalue().encode()


def order_members(members: list[Member]) -> list[Member]:
    """Package files sorted, then .dist-info files sorted (RECORD is appended last)."""
    return sorted(members, key=lambda m: (".dist-info/" in m.name, m.name))


# --------------------------------------------------------------------------------------------
# The patched tree


@dataclass
class TreeChange:
    status: str  # "A" added, "M" modified, "D" deleted
    path: str
    mode: int = 0o644
    blob: str = ""


def _git(tree: Path, *args: str, input: bytes | None = None) -> bytes:
    proc = subprocess.run(
        ["git", "-C", str(tree), *args], input=input, capture_output=True, check=False
    )
    if proc.returncode != 0:
        raise AfdError(f"git {' '.join(args)} in {tree} failed: {proc.stderr.decode().strip()}")
    return proc.stdout


def tree_changes(tree: Path, base_ref: str = BASE_REF) -> list[TreeChange]:
    """Files under vllm/ that HEAD adds, modifies or deletes relative to base_ref."""
    if not (tree / ".git").exists():
        raise AfdError(f"{tree} is not a git repository; run `make apply-patches` first")
    _git(tree, "rev-parse", "--verify", "--quiet", f"{base_ref}^{{commit}}")
    raw = _git(
        tree, "diff", "--raw", "--no-renames", "--no-abbrev", "-z", base_ref, "HEAD", "--", "vllm/"
    )
    fields = raw.split(b"\0")
    changes = []
    i = 0
    while i + 1 < len(fields) and fields[i]:
        meta = fields[i].decode().lstrip(":").split()
        path = fields[i + 1].decode()
        i += 2
        _old_mode, new_mode, _old_blob, new_blob, status = meta
        status = status[0]
        if status == "T":
            status = "M"
        if status not in "AMD":
            raise AfdError(f"{path}: unexpected git diff status {status}")
        if status != "D" and new_mode not in ("100644", "100755"):
            raise AfdError(f"{path}: mode {new_mode} (symlink or submodule) not supported")
        mode = 0o755 if new_mode == "100755" else 0o644
        changes.append(TreeChange(status, path, mode, new_blob))
    return sorted(changes, key=lambda c: c.path)


def read_blobs(tree: Path, blobs: list[str]) -> dict[str, bytes]:
    """Contents of git blobs, via one `git cat-file --batch`."""
    if not blobs:
        return {}
    out = _git(tree, "cat-file", "--batch", input=("\n".join(blobs) + "\n").encode())
    result: dict[str, bytes] = {}
    pos = 0
    for blob in blobs:
        nl = out.index(b"\n", pos)
        header = out[pos:nl].decode().split()
        if len(header) != 3 or header[1] != "blob":
            raise AfdError(f"git cat-file: unexpected header {header} for {blob}")
        size = int(header[2])
        result[blob] = out[nl + 1 : nl + 1 + size]
        pos = nl + 1 + size + 1
    return result


def tree_is_dirty(tree: Path) -> bool:
    return bool(_git(tree, "status", "--porcelain", "--untracked-files=no", "--", "vllm/").strip())


# --------------------------------------------------------------------------------------------
# Metadata rewriting


def wheel_version(base_version: str, rev: str, variant: str) -> str:
    v = f"{base_version}+afd.{rev}"
    return v + ".cpu" if variant == "cpu" else v


def wheel_filename(version: str) -> str:
    return f"vllm-{version}-{TAG}.whl"


_TORCH_CPU_RE = re.compile(r"^(Requires-Dist:\s*torch\s*==\s*[^;+\s]+)\+cpu(\s*;.*)?$")


def rewrite_metadata(text: str, version: str, variant: str) -> str:
    head, sep, body = text.partition("\n\n")
    lines = []
    for line in head.split("\n"):
        if line.startswith("Name:"):
            line = "Name: vllm"
        elif line.startswith("Version:"):
            line = f"Version: {version}"
        elif variant == "cpu":
            m = _TORCH_CPU_RE.match(line)
            if m:
                line = m.group(1) + (m.group(2) or "")
        lines.append(line)
    return "\n".join(lines) + sep + body


def rewrite_wheel_file(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith("Tag:"):
            continue
        if line.startswith("Generator:"):
            line = "Generator: afdtool-wheel (repacked from the upstream wheel)"
        lines.append(line)
    while lines and not lines[-1].strip():
        lines.pop()
    lines.append(f"Tag: {TAG}")
    return "\n".join(lines) + "\n\n"


def rewrite_version_module(data: bytes, version: str) -> bytes:
    """Point every quoted upstream version string in vllm/_version.py at ``version``."""
    text = data.decode()
    new, n = re.subn(
        r"^(__version__ = version = |__version__ = )'[^']*'",
        lambda m: f"{m.group(1)}'{version}'",
        text,
        flags=re.M,
    )
    if n != 1:
        raise AfdError(f"{VERSION_MODULE}: no single __version__ assignment to rewrite")
    return new.encode()


def revision_module(rev: str, vllm_version: str, variant: str) -> bytes:
    return (
        '"""Generated by afdtool wheel: the AFD patch-set revision of this build."""\n\n'
        f'AFD_REVISION = "{rev}"\n'
        f'AFD_VLLM_VERSION = "{vllm_version}"\n'
        f'AFD_VARIANT = "{variant}"\n'
    ).encode()


# --------------------------------------------------------------------------------------------
# Build


@dataclass
class BuildResult:
    path: Path
    version: str
    replaced: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    copied: int = 0
    up_to_date: bool = False

    def summary(self) -> str:
        size = self.path.stat().st_size / 1e6
        state = "up to date" if self.up_to_date else "built"
        return (
            f"{state}: {self.path} ({size:.1f} MB, version {self.version}): "
            f"{self.copied} upstream files copied, {len(self.replaced)} .py replaced, "
            f"{len(self.added)} added, {len(self.removed)} removed"
        )


def _find_dist_info(names: list[str]) -> str:
    dirs = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
    if len(dirs) != 1:
        raise AfdError(f"expected one .dist-info directory in the upstream wheel, got {dirs}")
    return dirs[0]


def mode_of(info: zipfile.ZipInfo) -> int:
    return 0o755 if (info.external_attr >> 16) & 0o111 else 0o644


def repack(
    upstream: Path,
    tree: Path,
    out_dir: Path,
    *,
    base_version: str,
    rev: str,
    variant: str,
    base_ref: str = BASE_REF,
) -> BuildResult:
    """Build the custom wheel from an upstream wheel and the patched tree (no stamp logic)."""
    if variant not in VARIANTS:
        raise AfdError(f"unknown variant {variant!r} (choose from {', '.join(VARIANTS)})")
    version = wheel_version(base_version, rev, variant)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / wheel_filename(version)
    changes = tree_changes(tree, base_ref)
    blobs = read_blobs(tree, [c.blob for c in changes if c.status != "D"])
    result = BuildResult(path=out_path, version=version)
    new_dist_info = f"vllm-{version}.dist-info"

    with zipfile.ZipFile(upstream) as src:
        infos = [i for i in src.infolist() if not i.filename.endswith("/")]
        names = [i.filename for i in infos]
        old_dist_info = _find_dist_info(names)
        by_name = {i.filename: i for i in infos}
        change_by_path = {c.path: c for c in changes}
        if REVISION_MODULE in by_name or REVISION_MODULE in change_by_path:
            raise AfdError(f"{REVISION_MODULE} is generated by afdtool wheel; the tree has one")

        members: list[Member] = []
        for info in infos:
            if not info.filename.startswith(old_dist_info + "/"):
                change = change_by_path.get(info.filename)
                members += _upstream_member(src, info, change, blobs, version, result)
        for change in changes:
            if change.path in by_name or change.status == "D":
                continue
            members.append(Member(change.path, change.mode, data=blobs[change.blob]))
            result.added.append(change.path)
        members.append(
            Member(REVISION_MODULE, 0o644, data=revision_module(rev, base_version, variant))
        )
        result.added.append(REVISION_MODULE)
        members += _dist_info_members(src, names, old_dist_info, new_dist_info, version,
                                      variant)  # fmt: skip

        members = order_members(members)
        record_name = f"{new_dist_info}/RECORD"
        record = record_bytes(members, record_name, src)
        members.append(Member(record_name, 0o644, data=record))
    write_zip(out_path, members, src_path=upstream)
    return result


def _upstream_member(src: zipfile.ZipFile, info: zipfile.ZipInfo, change, blobs: dict,
                     version: str, result: BuildResult) -> list[Member]:  # fmt: skip
    """What becomes of a file of the upstream wheel (not of its dist-info), given the
    tree's ``change`` of it (None: unchanged): kept as it is, replaced, or removed (no
    member); counted in ``result``."""
    name = info.filename
    if change is None and name == VERSION_MODULE:
        result.replaced.append(name)
        return [Member(name, mode_of(info), data=rewrite_version_module(src.read(info), version))]
    if change is None:
        result.copied += 1
        return [Member(name, mode_of(info), src=info)]
    if not name.endswith(".py"):
        raise AfdError(
            f"{name}: the series changes a non-.py file of the upstream wheel; "
            "compiled and data files must stay byte-identical"
        )
    if change.status == "D":
        result.removed.append(name)
        return []
    data = blobs[change.blob]
    if data == src.read(info):  # upstream wheel already matches the tree
        result.copied += 1
        return [Member(name, mode_of(info), src=info)]
    result.replaced.append(name)
    return [Member(name, change.mode, data=data)]


def _dist_info_members(src: zipfile.ZipFile, names: list[str], old_dist_info: str,
                       new_dist_info: str, version: str, variant: str) -> list[Member]:  # fmt: skip
    """The files of the upstream dist-info (of ``names``, the wheel's files) under
    ``new_dist_info`` (METADATA and WHEEL rewritten), but RECORD: the caller writes it last."""
    members = []
    for name in names:
        if not name.startswith(old_dist_info + "/"):
            continue
        rel = name[len(old_dist_info) + 1 :]
        if rel == "RECORD":
            continue
        data = src.read(name)
        if rel == "METADATA":
            data = rewrite_metadata(data.decode(), version, variant).encode()
        elif rel == "WHEEL":
            data = rewrite_wheel_file(data.decode()).encode()
        members.append(Member(f"{new_dist_info}/{rel}", 0o644, data=data))
    return members


# --------------------------------------------------------------------------------------------
# Inputs, stamps, CLI


def upstream_wheel(variant: str, pin: Pin) -> Path:
    """The cached, sha256-checked upstream wheel for a variant."""
    kind = f"wheel-{variant}"
    if importlib.util.find_spec("afdtool.fetch") is not None:
        from afdtool.fetch import fetch_artifact

        return Path(fetch_artifact(kind, pin=pin))
    key = "WHEEL_CUDA" if variant == "cuda" else "WHEEL_CPU"
    path = cache_dir() / pin.get(key)
    if not path.is_file():
        raise AfdError(f"upstream wheel {path} is missing; run `make fetch`")
    digest = sha256_file(path)
    if digest != pin.get(key + "_SHA256"):
        raise AfdError(f"{path}: sha256 {digest} does not match the pin {pin.get(key + '_SHA256')}")
    return path


def inputs_digest(upstream_sha: str, tree: Path, base_ref: str, version: str, variant: str) -> str:
    changes = tree_changes(tree, base_ref)
    doc = {
        "schema": _STAMP_SCHEMA,
        "upstream": upstream_sha,
        "version": version,
        "variant": variant,
        "changes": [[c.status, c.path, c.mode, c.blob] for c in changes],
        "epoch": list(zip_datetime()),
        "tool": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _stamp_path(out_path: Path) -> Path:
    return out_path.with_name("." + out_path.name + ".stamp")


def expected_wheel_path(variant: str, out_dir: Path, target: Target) -> Path:
    """dist/vllm-<target version>+afd.<target revision>[.cpu]-...whl."""
    return out_dir / wheel_filename(wheel_version(target.version, target.revision, variant))


def build(
    variant: str,
    target: Target,
    out_dir: Path,
    *,
    upstream: Path | None = None,
    force: bool = False,
) -> BuildResult:
    """The custom wheel of `target`: its pin's upstream wheel + its tree, named +afd.<its rev>."""
    pin, tree = target.pin, target.tree
    rev = target.revision
    version = wheel_version(pin.version, rev, variant)
    if upstream is None:
        upstream = upstream_wheel(variant, pin)
        upstream_sha = pin.get("WHEEL_CUDA_SHA256" if variant == "cuda" else "WHEEL_CPU_SHA256")
    else:
        upstream_sha = sha256_file(upstream)
    if tree_is_dirty(tree):
        print(f"warning: {tree} has uncommitted changes under vllm/; the wheel uses HEAD only")
    out_path = out_dir / wheel_filename(version)
    digest = inputs_digest(upstream_sha, tree, BASE_REF, version, variant)
    stamp = _stamp_path(out_path)
    if not force and out_path.is_file() and stamp.is_file():
        try:
            saved = json.loads(stamp.read_text())
        except ValueError:
            saved = {}
        if saved.get("inputs") == digest and saved.get("size") == out_path.stat().st_size:
            if saved.get("sha256") == sha256_file(out_path):
                res = BuildResult(path=out_path, version=version, up_to_date=True)
                res.copied = saved.get("copied", 0)
                res.replaced = saved.get("replaced", [])
                res.added = saved.get("added", [])
                res.removed = saved.get("removed", [])
                return res
    result = repack(upstream, tree, out_dir, base_version=pin.version, rev=rev, variant=variant)
    stamp.write_text(
        json.dumps(
            {
                "inputs": digest,
                "size": out_path.stat().st_size,
                "sha256": sha256_file(out_path),
                "copied": result.copied,
                "replaced": result.replaced,
                "added": result.added,
                "removed": result.removed,
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    # Older builds of the same variant (other patch-set revisions) would confuse `pip install
    # dist/*.whl`; remove them.
    pattern = re.compile(
        r"^vllm-"
        + re.escape(pin.version)
        + r"\+afd\.[0-9a-f]+"
        + (r"\.cpu" if variant == "cpu" else "")
        + "-"
        + re.escape(TAG)
        + r"\.whl$"
    )
    for old in out_dir.glob("vllm-*.whl"):
        if old != out_path and pattern.match(old.name):
            old.unlink()
            _stamp_path(old).unlink(missing_ok=True)
            print(f"removed stale {old}")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", choices=VARIANTS, default="cuda")
    parser.add_argument("--out", default=str(REPO_ROOT / "dist"))
    parser.add_argument("--upstream", default=None, help="use this upstream wheel file")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    result = build(
        args.variant,
        args.target,
        Path(args.out),
        upstream=Path(args.upstream) if args.upstream else None,
        force=args.force,
    )
    print(result.summary() + f" [{time.monotonic() - t0:.1f}s]")
    for label, items in (
        ("replaced", result.replaced),
        ("added", result.added),
        ("removed", result.removed),
    ):
        if items and not result.up_to_date:
            shown = ", ".join(items[:8]) + (f", ... (+{len(items) - 8})" if len(items) > 8 else "")
            print(f"  {label}: {shown}")
    return 0
