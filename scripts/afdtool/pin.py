"""Read the VLLM_VERSION pin file (key=value lines, '#' comments)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = (
    "VERSION",
    "TORCH",
    "SDIST",
    "SDIST_SHA256",
    "WHEEL_CUDA",
    "WHEEL_CUDA_SHA256",
    "WHEEL_CPU",
    "WHEEL_CPU_SHA256",
)


class PinError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pin:
    path: Path
    values: dict[str, str]

    @property
    def version(self) -> str:
        return self.values["VERSION"]

    def get(self, key: str) -> str:
        return self.values[key]


def parse_pin_text(text: str, path: Path) -> Pin:
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise PinError(f"{path}:{lineno}: expected KEY=VALUE, got {raw!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        if key in values:
            raise PinError(f"{path}:{lineno}: duplicate key {key}")
        values[key] = value
    missing = [k for k in REQUIRED_KEYS if not values.get(k)]
    if missing:
        raise PinError(f"{path}: missing keys: {', '.join(missing)}")
    return Pin(path=path, values=values)


def load_pin(path: Path) -> Pin:
    """Parse one pin file (targets.resolve picks which: the primary or targets/X/VLLM_VERSION)."""
    path = Path(path)
    if not path.is_file():
        raise PinError(f"pin file not found: {path}")
    return parse_pin_text(path.read_text(), path)


def cache_dir() -> Path:
    """Download cache: $AFD_CACHE_DIR, default ~/.cache/vllm-afd."""
    d = Path(os.environ.get("AFD_CACHE_DIR") or Path.home() / ".cache" / "vllm-afd")
    d.mkdir(parents=True, exist_ok=True)
    return d
