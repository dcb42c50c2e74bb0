"""The tools' layering, read from the source: no import circle in ``tools``, nothing in it imported
by the trainer (that no tool reaches past the engine's faces is tests/test_layering.py's)."""

from __future__ import annotations

from tests.support.imports import cycles, import_graph


def test_no_import_circle_in_the_tools_and_the_trainer_imports_none():
    graph = import_graph("tools")
    assert graph["tools.merge"]  # the walk sees imports
    assert cycles(graph) == []
    assert {name for name, targets in import_graph("trainer", "tools").items()
            if name.startswith("trainer") and any(t.startswith("tools") for t in targets)} == set()
