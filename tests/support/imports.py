"""The import graph of our packages, read from the source: every import statement, lazy ones inside
functions included (a lazy import that closes a circle is still a circle), and the engine names
each module imports (for the rule that ``tools/`` reaches no internal one)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Iterator


def modules(*packages: str) -> dict[str, Path]:
    """Every module of ``packages`` (``"ckpt"``, ``"trainer"``, ...) -> its source file."""
    found = {}
    for package in packages:
        root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
        for path in root.rglob("*.py"):
            parts = (package, *path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path) -> Iterator[tuple[ast.AST, str | None, list[str]]]:
    """``(node, absolute module, [imported names])`` of each import statement of module ``name``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            yield node, base, [alias.name for alias in node.names]


def import_graph(*packages: str) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (``from . import x`` counts as importing
    ``x``; the parent packages Python imports on the way do not count)."""
    known = modules(*packages)
    graph = {name: set() for name in known}
    for name, path in known.items():
        for node, base, names in _imports(name, path):
            if isinstance(node, ast.Import):
                targets = [base]
            else:
                subs = [f"{base}.{alias}" for alias in names if f"{base}.{alias}" in known]
                targets = subs + ([base] if len(subs) < len(names) else [])
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def private_reaches(package: str, into: str) -> list[str]:
    """Where a module of ``package`` imports an underscore name of ``into`` (``from ckpt.x import
    _y``, ``ckpt._x``) or reads an underscore attribute of something it imported from there
    (``commit._publish``): ``"module: what"`` for each."""
    found = []
    for name, path in modules(package).items():
        bound = set()  # local names that refer to something of ``into``
        for node, base, names in _imports(name, path):
            if base is None or not (base == into or base.startswith(into + ".")):
                continue
            private = [part for part in base.split(".") if part.startswith("_")]
            private += [alias for alias in names if alias.startswith("_")]
            found += [f"{name}: {base} {part}" for part in private]
            if isinstance(node, ast.Import):
                bound.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
            else:
                bound.update(alias.asname or alias.name for alias in node.names)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                value = node.value
                while isinstance(value, ast.Attribute):
                    value = value.value
                if isinstance(value, ast.Name) and value.id in bound:
                    found.append(f"{name}: {ast.unparse(node)}")
    return found
