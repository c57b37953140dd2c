"""The layering of the AFD modules: the imports between the modules of
overlay/vllm/afd, overlay/vllm/distributed/afd and overlay/vllm/config/afd.py form no
cycle (function-local imports included: a cycle held together by an import inside a
function is still a cycle), and no transport (vllm.distributed.afd.*) imports a role
module. Read from the source with ast, so it holds without importing anything."""

import ast
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[3] / "overlay"
PACKAGES = ("vllm/afd", "vllm/distributed/afd")
TRANSPORTS = "vllm.distributed.afd"
# What a connector may use of vllm.afd: the wire format, metrics, failure records, the
# connector spec records and the role helpers (vllm.afd.roles); never a role (its runners,
# its model split, its engine).
TRANSPORT_MAY_IMPORT = {"vllm.afd.protocol", "vllm.afd.metrics", "vllm.afd.failure",
                        "vllm.afd.roles", "vllm.afd.connector_spec"}  # fmt: skip


def module_files() -> dict[str, Path]:
    files = {"vllm.config.afd": OVERLAY / "vllm/config/afd.py"}
    for pkg in PACKAGES:
        for path in sorted((OVERLAY / pkg).glob("*.py")):
            parts = path.relative_to(OVERLAY).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``tree`` imports anywhere (``from pkg import mod``
    counts as an import of ``pkg.mod``; the packages' empty __init__ files are left out)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        found |= {n for n in names if n in known}
    return found - {"vllm.afd", TRANSPORTS}


def import_graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    files = files or module_files()
    known = set(files)
    return {
        name: imported(ast.parse(path.read_text(), str(path)), known) - {name}
        for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the
    end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def transport_role_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        if mod.startswith(TRANSPORTS + ".")
        for dep in deps
        if dep.startswith("vllm.afd.") and dep not in TRANSPORT_MAY_IMPORT
    )


def test_the_graph_sees_every_module_and_local_imports():
    graph = import_graph()
    for name in ("vllm.afd.attention", "vllm.afd.ffn_runner", "vllm.afd.model_split",
                 "vllm.afd.engine", "vllm.afd.roles", "vllm.distributed.afd.cuda_ipc",
                 "vllm.distributed.afd.tcp", "vllm.distributed.afd.nccl"):  # fmt: skip
        assert name in graph
    # A function-local import is an edge too (the old cycles hid in them).
    tree = ast.parse("def f():\n    from vllm.afd import attention\n")
    assert imported(tree, {"vllm.afd.attention"}) == {"vllm.afd.attention"}


def test_find_cycle_finds_one_through_three_modules():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_afd_modules_import_each_other_in_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "AFD import cycle: " + " -> ".join(cycle)


def test_no_transport_imports_a_role_module():
    bad = transport_role_imports(import_graph())
    assert not bad, f"transports import role modules: {bad} (move what they need to vllm.afd.roles)"
