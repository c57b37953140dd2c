"""The vLLM lines the series is carried to (VLLM_VERSION and targets/*/VLLM_VERSION) and the
shared overlay: the overlay knows every carried line (vllm.afd.architectures.LINES, the lines
with a CPU wheel), serves each family on the lines whose series marks it, and defines every
overlay name and AFDConfig method that a patch of any line calls (the overlay is shared, so a
patch carried to a new line may call something only that line's port added)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from afdtool import targets
from vllm.afd import architectures as arch
from vllm.config.afd import AFDConfig

ROOT = Path(__file__).resolve().parents[3]
OVERLAY = ROOT / "overlay"


def series_of(line: str) -> list[Path]:
    folder = targets.resolve(ROOT, line).patches
    names = [n for n in (folder / "series").read_text().split() if n.endswith(".patch")]
    return [folder / n for n in names]


def added_lines(line: str) -> list[tuple[str, str]]:
    """(patch file name, added line) of every patch of ``line``."""
    out = []
    for patch in series_of(line):
        for row in patch.read_text().splitlines():
            if row.startswith("+") and not row.startswith("+++"):
                out.append((patch.name, row[1:]))
    return out


def module_names(module: str) -> set[str] | None:
    """Names defined at module level by an overlay module (None: no such overlay module)."""
    base = OVERLAY / module.replace(".", "/")
    path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if not path.is_file():
        return None
    names = {p.stem for p in base.glob("*.py")} if base.is_dir() else set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets_ = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets_ if isinstance(t, ast.Name)}
    return names


IMPORT_RE = re.compile(r"^\s*from (vllm\.afd(?:\.\w+)*|vllm\.config\.afd) import \(?([\w, ]+)")
CALL_RE = re.compile(r"\bafd_config\.(\w+)\b")


def test_lines_are_the_carried_targets():
    """A target made with `make rebase` is a line the overlay must know (the config-time
    check refuses every family on a line missing here)."""
    assert arch.LINES == tuple(targets.carried(ROOT))


def test_cpu_lines_are_the_lines_with_a_cpu_wheel():
    with_wheel = [
        v
        for v in targets.carried(ROOT)
        if targets.resolve(ROOT, v).pin.get("WHEEL_CPU_SHA256") != "NONE"
    ]
    assert arch.CPU_LINES == tuple(with_wheel)


@pytest.mark.parametrize("line", ["0.33.0", "0.34.0"])
def test_families_are_served_on_the_new_lines(line):
    served = {
        f.name
        for f in arch.FAMILIES
        if arch.check(f.model_classes[0].split(".", 1)[1], f.model_classes[0], False, line) is None
    }
    gone = {"0.34.0": {"OLMoE"}}.get(line, set())  # see the OLMoE test below
    assert served == {f.name for f in arch.FAMILIES} - gone


def test_olmoe_is_refused_on_0_34_0_and_not_offered():
    """0.34.0 removed vLLM's own OLMoE model (the Transformers backend runs it), so no patch
    marks its block there."""
    olmoe = next(f for f in arch.FAMILIES if f.name == "OLMoE")
    assert "0.34.0" not in olmoe.lines and "0.33.0" in olmoe.lines
    msg = arch.check("OlmoeForCausalLM", "olmoe.OlmoeForCausalLM", False, "0.34.0")
    assert "is not AFD-enabled on vLLM 0.34.0" in msg
    assert "OLMoE" not in msg.split("Supported:", 1)[1]
    assert "Qwen3-MoE" in msg.split("Supported:", 1)[1]


CARRIED = targets.carried(ROOT)


@pytest.mark.parametrize("line", CARRIED)
def test_patches_import_only_what_the_overlay_defines(line):
    missing = []
    for patch, row in added_lines(line):
        m = IMPORT_RE.match(row)
        if not m:
            continue
        names = module_names(m.group(1))
        if names is None:
            missing.append(f"{patch}: no overlay module {m.group(1)}")
            continue
        for name in (n.strip().split(" as ")[0] for n in m.group(2).split(",")):
            if name and name not in names:
                missing.append(f"{patch}: {m.group(1)} has no {name}")
    assert missing == []


@pytest.mark.parametrize("line", CARRIED)
def test_patches_call_only_afd_config_methods_that_exist(line):
    """e.g. vLLM 0.34.0's VllmConfig.compile_factors calls afd_config.compile_factors()."""
    missing = {
        f"{patch}: AFDConfig.{name}"
        for patch, row in added_lines(line)
        for name in CALL_RE.findall(row)
        if not hasattr(AFDConfig, name)
    }
    assert missing == set()


def test_compile_factors_are_what_the_hash_covers():
    a = AFDConfig.from_dict({"role": "attention", "host": "10.0.0.1", "port": 1})
    b = AFDConfig.from_dict({"role": "attention", "host": "10.0.0.2", "port": 2})
    f = AFDConfig.from_dict({"role": "ffn"})
    assert a.compile_factors() == b.compile_factors() and a.compute_hash() == b.compute_hash()
    assert a.compile_factors()["role"] == "attention" and f.compile_factors()["role"] == "ffn"
    assert a.compute_hash() != f.compute_hash()
