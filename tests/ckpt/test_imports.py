"""The engine's layering, read from the source (every import statement, lazy ones inside functions
included): no import circle in ``ckpt``, and the spec (``ckpt.format``) imports nothing of the engine
above it (only itself and ``ckpt.errors``)."""

from __future__ import annotations

from tests.support.imports import cycles, import_graph


def test_no_import_circle_in_the_engine():
    graph = import_graph("ckpt")
    assert "ckpt.format.manifest" in graph and graph["ckpt.format.manifest"]  # the walk sees imports
    assert cycles(graph) == []


def test_the_spec_imports_nothing_above_it():
    upward = {(name, target) for name, targets in import_graph("ckpt").items() if name.startswith("ckpt.format")
              for target in targets if not target.startswith("ckpt.format") and target != "ckpt.errors"}
    assert upward == set()
