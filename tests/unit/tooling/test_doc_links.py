"""Every doc the docs, the README and the code point a reader to exists: a `docs/....md` path
named anywhere, a markdown link between docs (with its #anchor), and a section quoted as
`docs/X.md, "Section"` or `docs/X.md ("Section")`."""

from __future__ import annotations

import re
from pathlib import Path

import status_page

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ["README.md", "docs", "overlay", "tests", "scripts", "benchmarks", "Makefile", ".ci"]
SUFFIXES = {".md", ".py", ".sh", ".txt", ""}
# Files whose doc paths are made up on purpose (a test of a missing file).
MADE_UP = {"tests/unit/tooling/test_status_page.py", "tests/unit/tooling/test_doc_links.py"}

DOC_PATH = re.compile(r"\bdocs/[\w./-]+?\.md(?:#[\w.-]*[\w-])?")
MD_LINK = re.compile(r"\]\(([^)\s]+?\.md)(#[\w.-]+)?\)")
# docs/X.md, "Section ..." / docs/X.md ("Section ...")
QUOTED = re.compile(r"(docs/[\w./-]+?\.md),? \(?\\?\"([^\"\\]+)")


def scanned() -> list[Path]:
    files = []
    for entry in SCANNED:
        p = ROOT / entry
        candidates = [p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []
        files += [f for f in candidates if f.is_file() and f.suffix in SUFFIXES
                  and "__pycache__" not in f.parts
                  and str(f.relative_to(ROOT)) not in MADE_UP]
    return files


def headings(path: Path) -> list[str]:
    return re.findall(r"^#{1,6} +(.+?) *$", path.read_text(), flags=re.M)


def test_named_docs_exist_with_their_anchors_and_sections():
    missing = []
    for f in scanned():
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT)
        for ref in DOC_PATH.findall(text):
            path, _, anchor = ref.partition("#")
            if "YYYY" in path or anchor == "anchor":  # a placeholder in a format's description
                continue
            target = ROOT / path
            if not target.is_file():
                missing.append(f"{rel}: {ref} (no such file)")
            elif anchor and anchor not in status_page.heading_anchors(target.read_text()):
                missing.append(f"{rel}: {ref} (no such anchor)")
        for path, section in QUOTED.findall(text):
            section = re.sub(r"\s+", " ", section).strip()
            target = ROOT / path
            if target.is_file() and not any(h.startswith(section.split("\"")[0].strip())
                                             or section.startswith(h) for h in headings(target)):
                missing.append(f"{rel}: {path}, \"{section}\" (no such section)")
        if f.suffix == ".md":
            for link, anchor in MD_LINK.findall(text):
                if "://" in link:
                    continue
                target = (f.parent / link).resolve()
                if not target.is_file():
                    missing.append(f"{rel}: link {link} (no such file)")
                elif anchor and anchor[1:] not in status_page.heading_anchors(target.read_text()):
                    missing.append(f"{rel}: link {link}{anchor} (no such anchor)")
    assert not missing, "dangling doc references:\n" + "\n".join(missing)


def test_the_patterns_see_what_they_should():
    assert DOC_PATH.findall("see docs/gpu-tests.md, and docs/results/2026-12.md#a-b.") == [
        "docs/gpu-tests.md", "docs/results/2026-12.md#a-b"]
    assert QUOTED.findall('docs/benchmarks.md, "Dummy weights" and docs/x.md ("Y z")') == [
        ("docs/benchmarks.md", "Dummy weights"), ("docs/x.md", "Y z")]
    assert MD_LINK.findall("[log](results/2026-12.md#x) [m](models.md)") == [
        ("results/2026-12.md", "#x"), ("models.md", "")]
