# SPDX-License-Identifier: Apache-2.0
"""The identity of the checkpoint an AFD role serves (the handshake's ``checkpoint``).

Two checkpoints of one shape (two fine-tunes of one base, the two sides of a rolling
upgrade) agree on every size the fingerprint compares; the FFN rank would apply the
wrong weights without an error. Both roles therefore hash the checkpoint they load:

* ``config.json``, parsed and written back with sorted keys (whitespace does not count);
* every weight file vLLM loads from the checkpoint folder (its name and size), and
  - when the weight files hold at most ``FULL_HASH_MAX_BYTES`` together: every byte;
  - above that: each safetensors file's header (every tensor's name, dtype, shape and
    offsets) and ``SAMPLE_BYTES`` at the start, the middle and the end of each tensor's
    data (a fine-tune changes practically every value of the tensors it trains, so the
    samples of any trained tensor differ); another weight file (``.bin``, ``.pt``,
    ``.gguf``) by its first, middle and last ``FILE_SAMPLE_BYTES``;
* with ``load_format`` ``dummy`` (no weights): config.json and the load format.

The files are those of a local checkpoint folder, or of the Hugging Face cache snapshot
vLLM downloaded a hub model into (looked up offline: nothing is fetched here). The
identity reads at most a few pages per tensor from files the engine has just loaded
(in the page cache): tens of milliseconds for a 16 GB checkpoint.

It guards against a misconfiguration, not an adversary: a peer that can send a hello
can claim any identity (the shared secret is what keeps strangers out), and the sampled
form does not see a change that leaves every sampled byte as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

FULL_HASH_MAX_BYTES = 256 << 20
SAMPLE_BYTES = 256
FILE_SAMPLE_BYTES = 64 << 10
MAX_SAFETENSORS_HEADER = 100 << 20
DIGEST_CHARS = 24
_CHUNK = 8 << 20


class _Digest:
    """sha256 over labelled, length-prefixed parts (no two inputs hash alike by shifting
    bytes between parts)."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def part(self, label: str, data: bytes) -> None:
        self.h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    def hexdigest(self) -> str:
        return self.h.hexdigest()[:DIGEST_CHARS]


def resolve_folder(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> Path | None:
    """The local folder (or single weight file) of ``model``: a path as given, else the
    snapshot of the Hugging Face cache vLLM loaded it from; None when neither exists."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, cache_dir=download_dir,
                                      local_files_only=True))  # fmt: skip
    except Exception:  # noqa: BLE001 - not a hub model in the local cache
        return None


def weight_files(folder: Path, load_format: str = "auto") -> list[Path]:
    """The weight files vLLM loads from ``folder``: safetensors files (those the index
    names, when there is one), else ``.bin``, ``.pt`` or ``.gguf`` files."""
    if folder.is_file():
        return [folder]
    if load_format == "dummy":
        return []
    if load_format == "mistral":
        return sorted(folder.glob("consolidated*.safetensors"))
    found = sorted(folder.glob("*.safetensors"))
    if found:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            named = set(json.loads(index.read_text()).get("weight_map", {}).values())
            found = [f for f in found if f.name in named] or found
        return found
    for pattern in ("*.bin", "*.pt", "*.gguf"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    return []


def _sample_offsets(length: int, n: int) -> list[tuple[int, int]]:
    """(offset, size) of the start, middle and end samples of ``length`` bytes."""
    if length <= 3 * n:
        return [(0, length)]
    return [(0, n), (length // 2 - n // 2, n), (length - n, n)]


def _safetensors_parts(fd: int, size: int) -> Iterator[bytes]:
    """The header, then the samples of every tensor in file order; ValueError when the
    file is not safetensors."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise ValueError(f"header length {n} does not fit")
    header = os.pread(fd, n, 8)
    spans = sorted(
        tuple(v["data_offsets"]) for k, v in json.loads(header).items() if k != "__metadata__"
    )
    yield header
    for begin, end in spans:
        if not 0 <= begin <= end <= size - 8 - n:
            raise ValueError(f"tensor data {begin}..{end} outside the file")
        for at, count in _sample_offsets(end - begin, SAMPLE_BYTES):
            yield os.pread(fd, count, 8 + n + begin + at)


def _file_parts(fd: int, size: int) -> Iterator[bytes]:
    for at, count in _sample_offsets(size, FILE_SAMPLE_BYTES):
        yield os.pread(fd, count, at)


def _hash_file(digest: _Digest, path: Path, name: str, full: bool) -> None:
    size = path.stat().st_size
    digest.part("file", f"{name}:{size}".encode())
    with open(path, "rb") as f:
        if full:
            while chunk := f.read(_CHUNK):
                digest.h.update(chunk)
            return
        fd = f.fileno()
        if path.suffix == ".safetensors":
            try:
                parts = list(_safetensors_parts(fd, size))
            except (ValueError, KeyError, TypeError) as e:
                digest.part("not-safetensors", str(e).encode())
                parts = list(_file_parts(fd, size))
        else:
            parts = list(_file_parts(fd, size))
        for data in parts:
            digest.part("sample", data)


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _kind(files: list[Path]) -> str:
    kinds = sorted({f.suffix.lstrip(".") or f.name for f in files})
    return "/".join(kinds)


def identity(
    folder: Path | None,
    load_format: str = "auto",
    config: dict | None = None,
    full_max_bytes: int = FULL_HASH_MAX_BYTES,
) -> str:
    """``"<digest> (<what it covers>)"`` of the checkpoint in ``folder`` (a directory or a
    single weight file). ``config`` stands in for config.json when the folder has none."""
    digest = _Digest()
    base = None if folder is None else (folder if folder.is_dir() else folder.parent)
    cfg_path = None if base is None else base / "config.json"
    if cfg_path is not None and cfg_path.is_file():
        config, cfg_name = json.loads(cfg_path.read_text()), "config.json"
    else:
        cfg_name = "config (as loaded)"
    digest.part("config", json.dumps(config, sort_keys=True, default=str).encode())
    if load_format == "dummy":
        digest.part("weights", b"dummy")
        return f"{digest.hexdigest()} ({cfg_name}, load_format dummy: no weights)"
    files = [] if folder is None else weight_files(folder, load_format)
    if not files:
        note = f"no weight files found, load_format {load_format}"
        digest.part("weights", note.encode())
        return f"{digest.hexdigest()} ({cfg_name} only: {note})"
    total = sum(f.stat().st_size for f in files)
    full = total <= full_max_bytes
    digest.part("mode", b"full" if full else b"sampled")
    for f in files:
        _hash_file(digest, f, f.name, full)
    how = "every byte" if full else f"headers + 3 x {SAMPLE_BYTES} B of each tensor"
    count = f"{len(files)} {_kind(files)} file{'s' if len(files) > 1 else ''}"
    return f"{digest.hexdigest()} ({cfg_name} + {count}, {_human(total)}: {how})"


def checkpoint_identity(model_config, load_config) -> str:
    """The identity of the checkpoint this engine loaded (see :func:`identity`)."""
    model = getattr(model_config, "model_weights", "") or model_config.model
    folder = resolve_folder(str(model), getattr(model_config, "revision", None),
                            getattr(load_config, "download_dir", None))  # fmt: skip
    if folder is None and model != model_config.model:
        folder = resolve_folder(str(model_config.model))
    # Stands in for a missing config.json: the config vLLM parsed, without what names
    # the place or the library it was read with.
    config = {
        k: v
        for k, v in model_config.hf_config.to_dict().items()
        if not k.startswith("_") and k != "transformers_version"
    }
    return identity(folder, str(load_config.load_format).lower(), config)
