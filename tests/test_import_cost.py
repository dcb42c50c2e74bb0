"""Starting a process pays only for what its common path uses (issue 37, item 6): the suite starts
hundreds of trainer, torchrun-worker and CLI processes, and a user waits for every ``ckpt-inspect``.

Checked in a fresh interpreter by ``sys.modules``, not by timing: ``import trainer.train`` brings no
``torch._dynamo`` (context parallelism's causal bias and the pipeline's stages are imported on first
use); ``import ckpt`` and the CLIs that read manifests bring no ``torch.distributed.checkpoint`` and
no DTensor (the engine's faces import their DCP side on first use, :mod:`ckpt.lazy`). The faces
still give every name they gave: checked here too."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from tests.support import REPO

DCP = ("torch.distributed.checkpoint", "torch.distributed.tensor")
DYNAMO = ("torch._dynamo", "torch.distributed.pipelining", "torch.nn.attention.bias")


def modules_brought(imports: list[str], watched: tuple[str, ...]) -> dict[str, list[str]]:
    """For each of ``imports`` (module names, imported in turn by one fresh interpreter), the
    ``watched`` modules present after it."""
    code = ("import json, sys\n"
            f"watched, found = {watched!r}, {{}}\n"
            f"for name in {imports!r}:\n"
            "    __import__(name)\n"
            "    found[name] = [m for m in watched if m in sys.modules]\n"
            "print(json.dumps(found))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_trainer_imports_no_compiler_at_start():
    # a run builds its model on the meta device, where torch's own init imports dynamo anyway; this
    # keeps it out of everything before that: --help, the dry run, a refused config, tools.convert
    assert modules_brought(["trainer.train"], DYNAMO) == {"trainer.train": []}


def test_import_ckpt_brings_no_dcp():
    assert modules_brought(["ckpt"], DCP) == {"ckpt": []}


def test_the_tools_that_read_manifests_bring_no_dcp():
    tools = ["tools.cli", "tools.main", "tools.inspection", "tools.copy", "tools.prune"]
    assert modules_brought(tools, DCP) == {tool: [] for tool in tools}


@pytest.mark.parametrize("face", ["ckpt", "ckpt.read", "ckpt.convert"])
def test_a_lazy_face_gives_every_name_it_lists(face):
    module = importlib.import_module(face)
    for name in module.__all__:
        getattr(module, name)  # an AttributeError or ImportError fails the test
        assert name in dir(module)


def test_a_lazy_face_gives_submodules_and_refuses_unknown_names():
    import ckpt

    from ckpt import SafeLoadPlanner, dcp
    from ckpt.read import planner

    assert ckpt.root.open_root.__module__.startswith("ckpt.root")
    assert dcp.Reader is ckpt.read.Reader and SafeLoadPlanner is planner.SafeLoadPlanner
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ckpt.no_such_name
    with pytest.raises(AttributeError):
        ckpt.read._private
