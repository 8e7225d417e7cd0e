"""Every import statement of a tree of Python files, lazy ones inside functions included, resolved to the module it
names: read by the layer test (tests/test_config.py) and the test-module check (tests/test_docs.py). Not a test
module: test modules share helpers through modules like this one, never by importing each other."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Import:
    path: str
    """The importing file, relative to the repository root."""
    line: int
    module: str
    """The module named: `from a.b import c` names `a.b.c` where that is a module of the tree, else `a.b`."""
    attribute: str | None
    """`c` of `from a.b import c` where `a.b.c` is no module of the tree (a name `a.b` must define)."""


@functools.cache
def parse(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once per test session."""
    return ast.parse(path.read_text(), str(path))


def modules(package: str = "runner") -> dict[str, Path]:
    """Dotted name -> file, for every module of a package of the repository (a package by its `__init__.py`)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _base(node: ast.ImportFrom, module: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def of_file(path: Path, module: str, known: dict[str, Path]) -> list[Import]:
    """Every import of one file, wherever it stands (module level, functions, `if TYPE_CHECKING`)."""
    rel, out = path.relative_to(ROOT).as_posix(), []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out += [Import(rel, node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, module, path)
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append(Import(rel, node.lineno, full, None) if full in known else Import(rel, node.lineno, base, a.name))
    return out


def of_package(package: str = "runner") -> list[Import]:
    known = modules(package)
    return [imp for name, path in known.items() for imp in of_file(path, name, known)]


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports), and those of the
    blocks (`if`, `try`) there."""
    names: set[str] = set()
    body = list(parse(path).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try | ast.With):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            body += [n for h in getattr(node, "handlers", []) for n in h.body]
    return names


def private_uses(path: Path, module: str, known: dict[str, Path]) -> list[str]:
    """`file:line module._name` for each private name of another module of the tree that a file imports or reads
    (`from m import _x`, `m._x` where `m` names a module it imported)."""
    rel, tree, bound, out = path.relative_to(ROOT).as_posix(), parse(path), {}, []
    for imp in of_file(path, module, known):
        if imp.attribute and imp.attribute.startswith("_") and imp.module in known and imp.module != module:
            out.append(f"{rel}:{imp.line} {imp.module}.{imp.attribute}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _base(node, module, path)
            bound |= {a.asname or a.name: f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
        elif isinstance(node, ast.Import):
            bound |= {a.asname: a.name for a in node.names if a.asname and a.name in known}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            other = bound[node.value.id]
            if node.attr.startswith("_") and not node.attr.startswith("__") and other != module:
                out.append(f"{rel}:{node.lineno} {other}.{node.attr}")
    return out
