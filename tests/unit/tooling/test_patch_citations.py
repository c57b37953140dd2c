"""Docs, code comments and tests cite a patch by its Patch-Id trailer (the same on every
vLLM line), never by its number in a series (which differs between lines): every cited
Patch-Id exists in some line's series, and no "patch 0012" is left."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERIES_DIRS = [ROOT / "patches", *sorted((ROOT / "targets").glob("*/patches"))]
# Where a citation may stand: the docs, the README and every source or test file.
SCANNED = ["README.md", "docs", "overlay", "tests", "scripts", "benchmarks", "Makefile"]
SUFFIXES = {".md", ".py", ".sh", ""}

# "patch `id`", "patch ``id``", "patches `a`, `b` and `c`"
CITED = re.compile(r"\b[Pp]atch(?:es)?((?:,? (?:and )?`{1,2}[a-z0-9-]+`{1,2})+)")
CITED_ID = re.compile(r"`{1,2}([a-z0-9-]+)`{1,2}")
# "patch 0012", "patches 0012 and 0014", "0018 of targets/0.32.0" (a file name such as
# "patch 0001-Change-f7.patch" is not a citation by number)
BY_NUMBER = re.compile(r"\b[Pp]atch(?:es)? 0\d{3}(?![\w-])|\b0\d{3} of `?targets")


def patch_ids_of(patches: Path) -> dict[str, str]:
    """Patch-Id -> file name of each patch listed in ``patches``/series."""
    ids = {}
    for line in (patches / "series").read_text().splitlines():
        name = line.strip()
        if not name or name.startswith("#"):
            continue
        message = (patches / name).read_text().split("\ndiff --git ", 1)[0]
        found = re.findall(r"^Patch-Id: (\S+)$", message, flags=re.M)
        assert len(found) == 1, f"{patches / name}: {len(found)} Patch-Id trailers"
        ids[found[0]] = name
    return ids


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        p = ROOT / entry
        candidates = [p] if p.is_file() else sorted(p.rglob("*"))
        files += [f for f in candidates if f.is_file() and f.suffix in SUFFIXES
                  and "__pycache__" not in f.parts]
    return files


def citations(text: str) -> list[str]:
    return [i for m in CITED.finditer(text) for i in CITED_ID.findall(m.group(1))]


def test_every_line_names_every_patch():
    for patches in SERIES_DIRS:
        ids = patch_ids_of(patches)
        assert ids, patches
        assert len(set(ids.values())) == len(ids), f"{patches}: a Patch-Id used twice"


def test_citations_name_existing_patch_ids_and_no_numbers():
    known = set().union(*(patch_ids_of(p) for p in SERIES_DIRS))
    unknown, numbered, cited = [], [], set()
    for f in scanned_files():
        if f == Path(__file__):
            continue
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT)
        for patch_id in citations(text):
            cited.add(patch_id)
            if patch_id not in known:
                unknown.append(f"{rel}: patch `{patch_id}`")
        numbered += [f"{rel}: {m.group(0)!r}" for m in BY_NUMBER.finditer(text)]
    assert not unknown, "citations of unknown Patch-Ids:\n" + "\n".join(unknown)
    assert not numbered, "patches cited by number (cite the Patch-Id):\n" + "\n".join(numbered)
    assert "graph-capture-guard" in cited  # the scan does see the citations


@pytest.mark.parametrize("text, ids, by_number", [
    ("patch `graph-capture-guard` guards", ["graph-capture-guard"], False),
    ("patches `afd-config`, `afd-config-flag` and `forward-guard`",
     ["afd-config", "afd-config-flag", "forward-guard"], False),
    ("(patch ``end-with-parent``)", ["end-with-parent"], False),
    ("needs patch 0014 there", [], True),
    ("0018 of `targets/0.32.0`", [], True),
    ("patch 0001-Change-f7.patch (1 of 1) does not apply", [], False),
])
def test_citation_patterns(text, ids, by_number):
    assert citations(text) == ids
    assert bool(BY_NUMBER.search(text)) is by_number
