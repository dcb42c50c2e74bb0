"""Code outside the engine reaches it through its faces only (issue 37, item 4): ``ckpt``, its
top-level modules, its rooms' ``__init__`` (``ckpt.read``, ``ckpt.write``, ``ckpt.root``, ...) and
the plug-ins — never a module inside a room, an underscore module or name, or an underscore
attribute of something imported from the engine. Read from the source of the trainer, the tools,
the benchmarks and the scripts, lazy imports included."""

from __future__ import annotations

import pytest

from tests.support.imports import engine_faces, reaches_past_faces


@pytest.mark.parametrize("where", ["trainer", "tools", "benchmarks", "scripts"])
def test_code_outside_the_engine_uses_its_faces_only(where):
    assert reaches_past_faces(where) == []


def test_the_faces_are_the_rooms_and_the_top_level():
    faces = engine_faces()
    assert {"ckpt", "ckpt.api", "ckpt.dcp", "ckpt.read", "ckpt.write", "ckpt.inspect", "ckpt.root",
            "ckpt.root.catalog", "ckpt.storage", "ckpt.integrations.lightning"} <= faces
    assert not {"ckpt.read.source", "ckpt.write.files", "ckpt.root.copy", "ckpt.integrations._store"} & faces


def test_the_check_finds_each_kind_of_reach(tmp_path):
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "sample.py").write_text(
        "import ckpt.read.source\n"                       # a module inside a room
        "from ckpt.root.copy import holds_copy\n"         # the same, by from-import
        "from ckpt.read import prefetch\n"                # a room's submodule its face does not bind
        "from ckpt.storage import _posix_io\n"            # an underscore module
        "from ckpt.read import ChunkSource, _hidden\n"    # an underscore name
        "import ckpt.manager\n"
        "ckpt.manager.CheckpointManager._inflight\n"       # an underscore attribute
        "from ckpt import read, codec_like\n"
        "from ckpt.format import codec\n"                 # bound by the format face: fine
        "from ckpt.inspect import diff\n"                 # a function of the face named like its module: fine
        "def lazy():\n    from ckpt.write.staging import DoubleBufferStager\n")
    assert reaches_past_faces(folder) == sorted([
        "outside.sample: ckpt.read.source", "outside.sample: ckpt.root.copy", "outside.sample: ckpt.read.prefetch",
        "outside.sample: ckpt.storage._posix_io", "outside.sample: ckpt.storage _posix_io",
        "outside.sample: ckpt.read _hidden", "outside.sample: ckpt.manager.CheckpointManager._inflight",
        "outside.sample: ckpt.write.staging"])
