"""The engine's layering, read from the source (every import statement, lazy ones inside functions
included): no import circle in ``ckpt``, and the spec (``ckpt.format``) imports nothing of the engine
above it (only itself and ``ckpt.errors``)."""

from __future__ import annotations

import ast
from pathlib import Path

import ckpt

PACKAGE = Path(ckpt.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("ckpt", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    """module -> the ckpt modules it imports (``from . import x`` counts as importing ``x``; the
    parent packages Python imports on the way do not count)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_import_circle_in_the_engine():
    graph = _graph()
    assert "ckpt.format.manifest" in graph and graph["ckpt.format.manifest"]  # the walk sees imports
    assert _cycles(graph) == []


def test_the_spec_imports_nothing_above_it():
    upward = {(name, target) for name, targets in _graph().items() if name.startswith("ckpt.format")
              for target in targets if not target.startswith("ckpt.format") and target != "ckpt.errors"}
    assert upward == set()
