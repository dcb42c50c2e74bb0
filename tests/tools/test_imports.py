"""The tools' layering, read from the source: no import circle in ``tools``, nothing in it imported
by the trainer, the tools' own imports of the trainer in the graph (that no tool reaches past the
engine's faces is tests/test_layering.py's)."""

from __future__ import annotations

from tests.support.imports import cycles, import_graph


def test_no_import_circle_in_the_tools_and_the_trainer_imports_none():
    graph = import_graph("tools")
    assert graph["tools.merge"]  # the walk sees imports
    assert cycles(graph) == []
    assert {name for name, targets in import_graph("trainer", "tools").items()
            if name.startswith("trainer") and any(t.startswith("tools") for t in targets)} == set()


def test_ckpt_convert_imports_the_trainer_in_the_graph():
    """ckpt-convert's dependency on the trainer is a plain import (setup.py: under the checkout's
    name here, ``ckpt_trainer`` in a wheel), not a module loaded by name at run time."""
    graph = import_graph("trainer", "tools")
    assert {"trainer.hf", "trainer.titan", "trainer.config"} <= graph["tools.convert"]
    assert {"trainer.config", "trainer.model"} <= graph["tools.convert_model"]
