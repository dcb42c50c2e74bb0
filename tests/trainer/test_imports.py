"""The trainer's layering, read from the source (every import statement, lazy ones included): no
import circle in ``trainer``, none across ``ckpt``, ``trainer`` and ``tools`` together, and the engine
imports nothing of the trainer or the tools."""

from __future__ import annotations

from tests.support.imports import cycles, import_graph


def test_no_import_circle_in_the_trainer():
    graph = import_graph("trainer")
    assert graph["trainer.train"]  # the walk sees imports
    assert cycles(graph) == []


def test_no_import_circle_across_the_packages_and_the_engine_imports_neither_other():
    graph = import_graph("ckpt", "trainer", "tools")
    assert cycles(graph) == []
    upward = {(name, target) for name, targets in graph.items() if name.startswith("ckpt")
              for target in targets if not target.startswith("ckpt")}
    assert upward == set()
