"""Engines reach memory through the memory contract (p2phub.memory.Memory) alone: no module
branches on a registration's concrete class except the two classes themselves and the Hub's
factories that make them, none edits another object's in-flight count, and no class is found
through sys.modules (an import the import graph cannot see). Read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[2] / "p2phub"
REG_CLASSES = {"Registration", "StagedRegistration"}
# (module, enclosing class or function) where naming the concrete class is the point
ALLOWED = {("hub.py", "Registration"), ("staged.py", "StagedRegistration"),
           ("hub.py", "register"), ("hub.py", "alloc_host"), ("staged.py", "register"),
           ("staged.py", "register_host")}


def _names(node: ast.AST) -> set[str]:
    elts = node.elts if isinstance(node, ast.Tuple) else [node]
    out = set()
    for e in elts:
        if isinstance(e, ast.Name):
            out.add(e.id)
        elif isinstance(e, ast.Attribute):
            out.add(e.attr)
    return out


def _walk(tree: ast.AST):
    """(node, names of the enclosing classes and functions) for every node."""
    stack = [(tree, ())]
    while stack:
        node, scope = stack.pop()
        yield node, scope
        inner = scope + (node.name,) if isinstance(
            node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else scope
        stack.extend((c, inner) for c in ast.iter_child_nodes(node))


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path.relative_to(PKG).as_posix(), ast.parse(path.read_text(), str(path))


def test_no_isinstance_on_a_registration_class_outside_its_class_and_factories() -> None:
    found = []
    for mod, tree in _modules():
        for node, scope in _walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
                    and _names(node.args[1]) & REG_CLASSES
                    and not any((mod, s) in ALLOWED for s in scope)):
                found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    assert not found, "branches on a registration's class:\n" + "\n".join(found)


def test_no_module_edits_another_objects_hold_count() -> None:
    found = []
    for mod, tree in _modules():
        for node, _scope in _walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AugAssign) else [])
            for t in targets:
                if (isinstance(t, ast.Attribute) and t.attr in ("_busy", "holds")
                        and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "share"))):
                    found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_no_p2phub_class_is_found_through_sys_modules() -> None:
    found = []
    for mod, tree in _modules():
        for node, _scope in _walk(tree):
            key = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and ast.unparse(node.func.value) == "sys.modules"
                    and node.args):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
                key = node.slice
            if (isinstance(key, ast.Constant) and isinstance(key.value, str)
                    and key.value.startswith("p2phub")):
                found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)
