"""`afdtool drift --to X`: static AST check of overlay/'s vllm imports and keyword calls.

The target's pinned base (default: the newest carried target) and release X are parsed, never
imported. Statuses: `module deleted: M (path)`, `missing module`, `missing name N in M`,
`signature changed (old) -> (new)[; keyword(s) k no longer accepted]`. A parameter list that
only gains optional parameters (or *args / **kwargs) is compatible and not reported.
"""

from __future__ import annotations

import ast
import time
from dataclasses import dataclass, field
from pathlib import Path

from .apply import BASE_TAG, prepare_base
from .errors import AfdError
from .gitutil import git
from .index import release_base, release_pin
from .series import overlay_files
from .targets import Target


class Source:
    """Module-level facts about one vLLM source tree (afd/base of a pristine repo, or a dir)."""

    def __init__(self, location: Path, rev: str | None = BASE_TAG):
        self.loc, self.rev = location, rev
        if rev:
            names = git(location, "ls-tree", "-r", "--name-only", rev)
            self.files = set(names.splitlines())
        else:
            self.files = {p.relative_to(location).as_posix() for p in location.rglob("*.py")}
        self._mods: dict[str, dict | None] = {}

    def path_of(self, mod: str) -> str | None:
        base = mod.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self.files:
                return cand
        return None

    def is_package_dir(self, mod: str) -> bool:
        prefix = mod.replace(".", "/") + "/"
        return any(f.startswith(prefix) for f in self.files)

    def read(self, rel: str) -> str:
        if self.rev:
            return git(self.loc, "show", f"{self.rev}:{rel}")
        return (self.loc / rel).read_text(errors="replace")

    def module(self, mod: str) -> dict | None:
        if mod in self._mods:
            return self._mods[mod]
        rel = self.path_of(mod)
        info = None
        if rel:
            try:
                tree = ast.parse(self.read(rel))
            except SyntaxError:
                tree = ast.Module(body=[], type_ignores=[])
            pkg = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
            info = {"names": {}, "dynamic": False}
            _collect(tree.body, info, pkg)
        self._mods[mod] = info
        return info

    def exists(self, mod: str) -> bool:
        return self.path_of(mod) is not None or self.is_package_dir(mod)

    def has(self, mod: str, name: str) -> bool:
        info = self.module(mod)
        if self.exists(f"{mod}.{name}"):
            return True
        return bool(info and (name in info["names"] or info["dynamic"]))

    def resolve(self, mod: str, name: str, depth: int = 0):
        info = self.module(mod)
        if not info or depth > 6:
            return None
        node = info["names"].get(name)
        if isinstance(node, tuple):  # re-export: ("from", module, name)
            return self.resolve(node[1], node[2], depth + 1)
        return node


def _collect(body, info: dict, pkg: str) -> None:
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info["names"][st.name] = st
            if st.name == "__getattr__":
                info["dynamic"] = True
        elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            tgts = st.targets if isinstance(st, ast.Assign) else [st.target]
            for t in tgts:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        info["names"].setdefault(n.id, st)
        elif isinstance(st, ast.Import):
            for a in st.names:
                info["names"][a.asname or a.name.split(".")[0]] = st
        elif isinstance(st, ast.ImportFrom):
            base = _abs_module(st, pkg)
            for a in st.names:
                if a.name == "*":
                    info["dynamic"] = True
                else:
                    info["names"][a.asname or a.name] = ("from", base, a.name)
        elif isinstance(st, (ast.If, ast.Try, ast.With)) or type(st).__name__ == "TryStar":
            for part in ("body", "orelse", "finalbody"):
                _collect(getattr(st, part, []) or [], info, pkg)
            for h in getattr(st, "handlers", []) or []:
                _collect(h.body, info, pkg)


def _abs_module(node: ast.ImportFrom, pkg: str) -> str:
    if not node.level:
        return node.module or ""
    parts = pkg.split(".") if pkg else []
    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join(parts + ([node.module] if node.module else []))


def signature(node) -> list[str] | None:
    if isinstance(node, ast.ClassDef):
        for st in node.body:
            if isinstance(st, ast.FunctionDef) and st.name == "__init__":
                return signature(st)[1:]
        fields = []
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                if "ClassVar" in ast.unparse(st.annotation):
                    continue
                fields.append(st.target.id + ("=" if st.value is not None else ""))
        return fields or None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    out: list[str] = []
    pos = a.posonlyargs + a.args
    ndef = len(a.defaults)
    for i, arg in enumerate(pos):
        out.append(arg.arg + ("=" if i >= len(pos) - ndef else ""))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            out.append("/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(arg.arg + ("=" if d is not None else ""))
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


@dataclass
class Ref:
    kind: str  # module | name | call
    module: str
    name: str
    where: str
    keywords: list[str] = field(default_factory=list)


def overlay_refs(overlay: Path) -> tuple[list[Ref], set[str]]:
    """References from overlay .py files into vllm modules, and the overlay's own modules."""
    files = {rel: p for rel, p in overlay_files(overlay).items() if rel.endswith(".py")}
    own = set()
    for rel in files:
        m = rel[:-3].replace("/", ".")
        own.add(m[: -len(".__init__")] if m.endswith(".__init__") else m)
    refs: list[Ref] = []
    for rel, p in files.items():
        mod = rel[:-3].replace("/", ".")
        pkg = mod[: -len(".__init__")] if mod.endswith(".__init__") else mod.rpartition(".")[0]
        try:
            tree = ast.parse(p.read_text(errors="replace"))
        except SyntaxError as exc:
            raise AfdError(f"overlay/{rel}: {exc}") from None
        aliases: dict[str, tuple[str, str | None]] = {}  # local -> (module, name or None)
        for node in ast.walk(tree):
            where = f"overlay/{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "vllm" or a.name.startswith("vllm."):
                        refs.append(Ref("module", a.name, a.name, where))
                        aliases[a.asname or "vllm"] = (a.name if a.asname else "vllm", None)
            elif isinstance(node, ast.ImportFrom):
                base = _abs_module(node, pkg)
                if not (base == "vllm" or base.startswith("vllm.")):
                    continue
                for a in node.names:
                    if a.name == "*":
                        continue
                    refs.append(Ref("name", base, a.name, where))
                    aliases[a.asname or a.name] = (base, a.name)
        for node in ast.walk(tree):
            where = f"overlay/{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute):
                chain = _dotted(node)
                if chain and chain[0] in aliases:
                    mod0, name0 = aliases[chain[0]]
                    refs.append(Ref("attr", mod0 if name0 is None else f"{mod0}.{name0}",
                                    ".".join(chain[1:]), where))
            elif isinstance(node, ast.Call):
                kws = [k.arg for k in node.keywords if k.arg]
                if not kws:
                    continue
                chain = _dotted(node.func)
                if chain and chain[0] in aliases:
                    mod0, name0 = aliases[chain[0]]
                    full = ([mod0] if name0 is None else [mod0, name0]) + chain[1:]
                    refs.append(Ref("call", ".".join(full[:-1]), full[-1], where, kws))
    return refs, own


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _split(src: Source, dotted: str) -> tuple[str, list[str]] | None:
    """Longest module prefix of a dotted name in src, and the remaining attribute names."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if src.exists(".".join(parts[:i])):
            return ".".join(parts[:i]), parts[i:]
    return None


def _owned(mod: str, own: set[str]) -> bool:
    return any(mod == o or mod.startswith(o + ".") for o in own)


def drift_findings(old: Source, new: Source, overlay: Path) -> list[tuple[str, str, str]]:
    """[(name, where, status)] for overlay references that hold in old but not in new."""
    refs, own = overlay_refs(overlay)
    found: dict[tuple[str, str], str] = {}

    def lookup(src: Source, dotted: str):
        """-> ('module-missing', mod) | ('name-missing', mod, attr) | ('ok', node|None)"""
        sp = _split(src, dotted)
        if sp is None:
            return ("module-missing", dotted.split(".")[0])
        mod, rest = sp
        if not rest:
            return ("ok", None)
        if not src.has(mod, rest[0]):
            return ("name-missing", mod, rest[0])
        node = src.resolve(mod, rest[0])
        for attr in rest[1:]:  # Class.attr: one level into class bodies
            if isinstance(node, ast.ClassDef):
                sub = next((n for n in node.body if getattr(n, "name", None) == attr), None)
                node = sub
            else:
                return ("ok", None)
        return ("ok", node)

    for r in refs:
        full = r.module if r.kind == "module" else f"{r.module}.{r.name}"
        if _owned(full, own) or _owned(r.module, own):
            continue
        was, now = lookup(old, full), lookup(new, full)
        if was[0] != "ok":
            continue  # not resolvable in the pinned tree either (dynamic/patch-added): skip
        gone = deleted_module(old, new, full)
        if gone:
            found.setdefault((full, r.where), f"module deleted: {gone} ({old.path_of(gone) or gone})")
        elif now[0] == "module-missing" or (now[0] == "name-missing" and r.kind == "module"):
            status = f"missing module (under {now[1]})" if now[0] == "module-missing" else \
                "missing module"
            found.setdefault((full, r.where), status)
        elif now[0] == "name-missing":
            found.setdefault((full, r.where), f"missing name {now[2]} in {now[1]}")
        elif r.kind == "call":
            status = signature_change(signature(was[1]), signature(now[1]), r.keywords)
            if status:
                found[(full, r.where)] = status
    return [(name, where, status) for (name, where), status in sorted(found.items())]


def deleted_module(old: Source, new: Source, dotted: str) -> str | None:
    """The module of `dotted` in the old tree when the new tree no longer has it."""
    sp = _split(old, dotted)
    if sp is None or new.exists(sp[0]):
        return None
    return sp[0]


def compatible(so: list[str], sn: list[str]) -> bool:
    """sn only adds to so: every old parameter kept in order (same kind), each new one optional
    (`x=`), a `*args` / `**kwargs`, or the `*` marker."""
    it = iter(sn)
    for p in so:
        for q in it:
            if q == p:
                break
            if not (q.endswith("=") or q.startswith("*")):
                return False
        else:
            return False
    return all(q.endswith("=") or q.startswith("*") for q in it)


def signature_change(so: list[str] | None, sn: list[str] | None, keywords: list[str]) -> str:
    """'' when the call still binds the same way (no change, or only compatible additions)."""
    if so is None or sn is None or so == sn or compatible(so, sn):
        return ""
    accepted = {s.strip("*=") for s in sn}
    lost = [k for k in keywords if k not in accepted]
    if any(s.startswith("**") for s in sn):
        lost = []
    extra = f"; keyword(s) {', '.join(lost)} no longer accepted" if lost else ""
    return f"signature changed ({', '.join(so)}) -> ({', '.join(sn)}){extra}"


def drift(target: Target, to: str, source=None, strict=False) -> int:
    """Findings of overlay/ against release `to`, relative to `target`'s pinned base."""
    old_pristine, _ = prepare_base(target, None)
    values = release_pin(to, source, need_wheels=False)
    new_pristine, _ = release_base(values, source)
    t0 = time.monotonic()
    findings = drift_findings(Source(old_pristine), Source(new_pristine), target.overlay)
    for name, where, status in findings:
        print(f"{name}  {where}  {status}")
    print(f"drift {target.version} -> {to}: {len(findings)} finding(s) "
          f"({time.monotonic() - t0:.1f}s)")
    return 1 if strict and findings else 0


def add_arguments(p) -> None:
    p.add_argument("--to", required=True, metavar="X")
    p.add_argument("--source", help="where to get X's sdist")
    p.add_argument("--strict", action="store_true", help="exit 1 when there is drift")


def run(args) -> int:
    how = "the newest carried target older than --to" if args.target_default else "--target"
    print(f"drift: relative to {args.target.describe()} ({how})")
    return drift(args.target, args.to, args.source, args.strict)
