"""The tools' layering, read from the source: no import circle in ``tools``, nothing in it imported
by the trainer, and no tool reaches an internal engine name (an underscore module, name or
attribute of ``ckpt``)."""

from __future__ import annotations

from tests.support.imports import cycles, import_graph, private_reaches


def test_no_import_circle_in_the_tools_and_the_trainer_imports_none():
    graph = import_graph("tools")
    assert graph["tools.merge"]  # the walk sees imports
    assert cycles(graph) == []
    assert {name for name, targets in import_graph("trainer", "tools").items()
            if name.startswith("trainer") and any(t.startswith("tools") for t in targets)} == set()


def test_the_tools_use_only_public_engine_names():
    assert private_reaches("tools", "ckpt") == []
