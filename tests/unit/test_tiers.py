"""The product's imports run one way: core <- engines <- tools, and no module imports itself
back through others. Read from the source with ast, so an import inside a function counts as
much as one at the top; only imports under ``if TYPE_CHECKING:`` (never run) are left out.

- core: errors, uapi, device, pci, resource, backend, sources, host memory, the memory
  contract, capability facts and the path policy: what every engine builds on;
- engines: the Hub, staged mode, NVMe, RDMA, ordering, KV: the data path;
- tools: the doctor, the commands and benchmarks, the CLI: they read the engines, the
  engines never read them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TOP = Path(__file__).resolve().parents[2]
PKG = TOP / "p2phub"

CORE = {"p2phub", "p2phub.errors", "p2phub.uapi", "p2phub.device", "p2phub.pci",
        "p2phub._resource", "p2phub.backend", "p2phub.sources", "p2phub.hostmem",
        "p2phub.arrays", "p2phub.blockuse", "p2phub.exitcodes", "p2phub._cffi_build",
        "p2phub.memory", "p2phub.capabilities", "p2phub.policy", "p2phub.log", "p2phub.deps",
        "p2phub.metrics"}
ENGINE_PREFIXES = ("p2phub.hub", "p2phub.files", "p2phub.staged", "p2phub.nvme", "p2phub.rdma",
                   "p2phub.ordering", "p2phub.kv", "p2phub.batch", "p2phub.staged_io",
                   "p2phub.nixl")
TOOL_PREFIXES = ("p2phub.doctor", "p2phub.commands", "p2phub.cli", "p2phub.__main__")
TIER_NAMES = ("core", "engine", "tool")

# Import edges that still close a cycle, each to be removed by the change that owns its
# package; the test fails once one is gone, so this list only shrinks.
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()

# The same for imports under ``if TYPE_CHECKING:``: never run, but a module that names another
# only for its types still depends on it, and a cycle of them is one design knot.
ALLOWED_TYPE_CYCLE_EDGES = {
    # the batch engine and staged mode take the Hub as a parameter (hub <-> engines)
    ("p2phub.batch", "p2phub.hub"),
    ("p2phub.staged", "p2phub.hub"),
    # the recovery state machine drives its controller (a dozen of its methods)
    ("p2phub.nvme.recovery", "p2phub.nvme.controller"),
}

# Private members (``x._name``) read on an object other than self/cls, in core and engines,
# counted per module and name: tests/unit/private_reads.txt. New ones fail, and so does a
# count that fell (lower it: the list only shrinks). Regenerate after a deliberate change
# with ``python tests/unit/test_tiers.py --write-private-reads``.
PRIVATE_READS = Path(__file__).with_name("private_reads.txt")
_PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # namedtuple


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def tier(name: str) -> int:
    if name in CORE:
        return 0
    if _under(name, TOOL_PREFIXES):
        return 2
    if _under(name, ENGINE_PREFIXES):
        return 1
    raise AssertionError(f"{name} belongs to no tier: add it to CORE, ENGINE_PREFIXES or "
                         "TOOL_PREFIXES in tests/unit/test_tiers.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(TOP).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def _type_only_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                out.update(id(n) for n in ast.walk(inner))
    return out


def imports_of(name: str, path: Path, known: set[str], type_only: bool = False) -> set[str]:
    """Modules of p2phub that `name` imports at run time (module or function level); with
    `type_only`, also those it imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if type_only else _type_only_nodes(tree)
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("p2phub"):
                continue
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out.update(subs)
            if len(subs) < len(node.names) and mod in known:
                out.add(mod)
    out.discard(name)
    return out


def graph(type_only: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: imports_of(m, p, known, type_only) for m, p in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_whole_package_is_read() -> None:
    g = graph()
    assert {"p2phub.hub", "p2phub.staged", "p2phub.memory", "p2phub.doctor.checks.pairs",
            "p2phub.nvme.namespace", "p2phub.kv.transport"} <= set(g)
    assert "p2phub.doctor.core" not in g["p2phub.staged"]


def test_every_module_has_a_tier() -> None:
    for m in graph():
        tier(m)


def test_no_import_goes_up_a_tier() -> None:
    bad = [f"{a} ({TIER_NAMES[tier(a)]}) imports {b} ({TIER_NAMES[tier(b)]})"
           for a, targets in sorted(graph().items()) for b in sorted(targets) if tier(b) > tier(a)]
    assert not bad, "imports that go up a tier:\n" + "\n".join(bad)


def _check_cycles(g: dict[str, set[str]], allowed: set[tuple[str, str]], name: str) -> None:
    for a, b in allowed:
        assert b in g.get(a, set()), f"{a} -> {b} is gone: remove it from {name}"
        g[a] = g[a] - {b}
    found = cycles(g)
    assert not found, "import cycles in p2phub/:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycle() -> None:
    assert not ALLOWED_CYCLE_EDGES, "a run-time import cycle is never allowed again"
    _check_cycles(graph(), ALLOWED_CYCLE_EDGES, "ALLOWED_CYCLE_EDGES")


def test_no_import_cycle_counting_type_only_imports() -> None:
    _check_cycles(graph(type_only=True), ALLOWED_TYPE_CYCLE_EDGES, "ALLOWED_TYPE_CYCLE_EDGES")


def private_reads(path: Path) -> dict[str, int]:
    """``_name``: how often `path` reads it on something other than self, cls or super()."""
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or (attr.startswith("__") and attr.endswith("__")):
            continue
        if attr in _PUBLIC_UNDERSCORE:
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        out[attr] = out.get(attr, 0) + 1
    return out


def current_private_reads() -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for name, path in _modules().items():
        if tier(name) == 2:
            continue
        for attr, n in private_reads(path).items():
            out[(name, attr)] = n
    return out


def allowed_private_reads() -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for line in PRIVATE_READS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            mod, attr, n = line.split()
            out[(mod, attr)] = int(n)
    return out


def write_private_reads() -> None:
    rows = sorted(current_private_reads().items())
    PRIVATE_READS.write_text(
        "# module, private member read on another object, count (tests/unit/test_tiers.py)\n"
        + "".join(f"{m} {a} {n}\n" for (m, a), n in rows))


def test_private_reads_across_objects_only_shrink() -> None:
    now, allowed = current_private_reads(), allowed_private_reads()
    new = [f"{m}: {a} read {n} time(s), {allowed.get((m, a), 0)} allowed"
           for (m, a), n in sorted(now.items()) if n > allowed.get((m, a), 0)]
    gone = [f"{m}: {a} now read {now.get((m, a), 0)} time(s), {n} listed"
            for (m, a), n in sorted(allowed.items()) if now.get((m, a), 0) < n]
    assert not new, ("private members read on other objects (give the owner a public "
                     "accessor or a hook):\n" + "\n".join(new))
    assert not gone, (f"fewer private reads than {PRIVATE_READS.name} lists: lower it "
                      "(the list only shrinks):\n" + "\n".join(gone))


def test_the_private_read_counter(tmp_path) -> None:
    src = ("class A:\n    def f(self, other):\n        self._a; cls = 1; other._b; other._b\n"
           "        super()._c; other.__dict__; t._replace(); mod._d\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    assert private_reads(path) == {"_b": 2, "_d": 1}


def test_the_reader_sees_function_level_imports_and_cycles(tmp_path) -> None:
    src = ("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "    from .hub import Hub\n"
           "def f():\n    from .doctor import core\n    from . import uapi, nothere\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    known = {"p2phub", "p2phub.hub", "p2phub.doctor", "p2phub.doctor.core", "p2phub.uapi"}
    got = imports_of("p2phub.probe", path, known)
    assert got == {"p2phub.doctor.core", "p2phub.uapi", "p2phub"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _imported_names(name: str, path: Path, known: set[str]) -> list[tuple[int, str, str]]:
    """(line, module, name) for every `from <p2phub module> import name` in `path` that names
    something other than a submodule, at module or function level."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        if mod not in known:
            continue
        out += [(node.lineno, mod, a.name) for a in node.names
                if a.name != "*" and f"{mod}.{a.name}" not in known]
    return out


def test_every_imported_name_exists() -> None:
    """An import inside a function runs only when that function does: a name moved to another
    module must fail here, not in the first user's call."""
    import importlib

    mods = _modules()
    known = set(mods)
    missing = []
    for name, path in sorted(mods.items()):
        for line, mod, attr in _imported_names(name, path, known):
            try:
                target = importlib.import_module(mod)
            except ImportError:
                continue    # an optional dependency of that module is absent here
            if not hasattr(target, attr):
                missing.append(f"{path.relative_to(TOP)}:{line}: {mod} has no {attr!r}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-private-reads"]:
        write_private_reads()
        print(f"wrote {PRIVATE_READS}")
    else:
        sys.exit("usage: python tests/unit/test_tiers.py --write-private-reads")
