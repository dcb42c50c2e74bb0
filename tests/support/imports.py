"""The import graph of our packages, read from the source: every import statement, lazy ones inside
functions included (a lazy import that closes a circle is still a circle), and the engine names
each module imports (for the rule that code outside the engine uses its faces only)."""

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


def engine_faces(into: str = "ckpt") -> set[str]:
    """The names of ``into`` code outside it may import: the package itself, each top-level module
    without an underscore, each room (a package, at any depth: its ``__init__`` is its face) and the
    plug-ins (``ckpt.integrations.<framework>``, each the face its framework meets)."""
    root = Path(importlib.util.find_spec(into).submodule_search_locations[0])
    faces = {into}
    for name, path in modules(into).items():
        parts = name.split(".")
        if any(part.startswith("_") for part in parts):
            continue
        if path.name == "__init__.py" or len(parts) == 2 or parts[:2] == [into, "integrations"]:
            faces.add(name)
    assert root.is_dir()
    return faces


def _bound_submodules(face: Path) -> set[str]:
    """The names a room's face binds (``from . import codec``, ``from .diff import diff``): importing
    one of them from the face is through the face, even where a submodule has the same name."""
    return {alias.asname or alias.name for node in ast.parse(face.read_text()).body
            if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names}


def _source_files(where: str | Path) -> dict[str, Path]:
    """``where`` is a package (``"trainer"``) or a folder of scripts (``"benchmarks"``, or a path):
    module name -> file."""
    if isinstance(where, str):
        spec = importlib.util.find_spec(where)
        if spec is not None and spec.submodule_search_locations:
            return modules(where)
        where = Path(__file__).resolve().parents[2] / where
    return {f"{where.name}.{path.stem}": path for path in sorted(where.glob("*.py"))}


def reaches_past_faces(where: str | Path, into: str = "ckpt") -> list[str]:
    """Where code of ``where`` (a package or a folder of scripts) reaches ``into`` past its faces
    (:func:`engine_faces`): a module inside a room (``from ckpt.read.source import X``, ``import
    ckpt.root.copy``, ``from ckpt.read import prefetch``), or an underscore module, name or attribute
    (``from ckpt.x import _y``, ``manager._inflight``): ``"module: what"`` for each."""
    faces, known = engine_faces(into), modules(into)
    faces |= {f"{face}.{sub}" for face in list(faces) if known[face].name == "__init__.py"
              for sub in _bound_submodules(known[face])}
    found = []
    for name, path in _source_files(where).items():
        bound = set()  # local names that refer to something of ``into``
        for node, base, names in _imports(name, path):
            if base is None or not (base == into or base.startswith(into + ".")):
                continue
            targets = [base] if isinstance(node, ast.Import) else \
                [f"{base}.{alias}" for alias in names if f"{base}.{alias}" in known] or [base]
            found += [f"{name}: {target}" for target in targets if target not in faces]
            found += [f"{name}: {base} {alias}" for alias in names if alias.startswith("_")]
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
    return sorted(set(found))
