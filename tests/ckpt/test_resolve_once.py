"""Resolve once at the door (issue 37 item 3e): a public entry point turns a path or URL into a
:class:`~ckpt.storage.Location` once and passes it inward; nothing inside calls ``locate`` again.

Counted by wrapping every binding of :func:`ckpt.storage.locate` in the engine's modules: each call
given a path or URL (a Location passes through ``locate`` unchanged: nothing is resolved)."""

from __future__ import annotations

import sys

import pytest

import ckpt
import ckpt.convert
import ckpt.storage
from tests.support.checkpoints import assert_state_equal, blank_state, make_state
from tests.support.dcp_sources import save_small


@pytest.fixture
def locate_calls(monkeypatch) -> list:
    calls, real = [], ckpt.storage.locate

    def counted(target, *args, **kwargs):
        if not isinstance(target, ckpt.storage.Location):  # a Location passes through: nothing resolved
            calls.append(target)
        return real(target, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (name == "ckpt" or name.startswith("ckpt.")) and getattr(module, "locate", None) is real:
            monkeypatch.setattr(module, "locate", counted)
    return calls


def test_a_load_resolves_its_path_once(tmp_path, locate_calls):
    state = make_state(1)
    ckpt.save(state, tmp_path / "c", no_dist=True)
    locate_calls.clear()
    live = blank_state()
    ckpt.load(live, str(tmp_path / "c"), no_dist=True)
    assert_state_equal(live, state)
    assert locate_calls == [str(tmp_path / "c")]


def test_a_mirror_is_resolved_once_too(tmp_path, locate_calls):
    state = make_state(2)
    ckpt.save(state, tmp_path / "c", no_dist=True)
    locate_calls.clear()
    ckpt.load(blank_state(), tmp_path / "c", no_dist=True, mirrors=(str(tmp_path / "replica"),))
    assert locate_calls == [tmp_path / "c", str(tmp_path / "replica")]


def test_a_save_resolves_its_path_once(tmp_path, locate_calls):
    ckpt.save(make_state(3), str(tmp_path / "c"), no_dist=True)
    assert locate_calls == [str(tmp_path / "c")]
    assert ckpt.read_manifest(tmp_path / "c").step is None


def test_a_manager_resolves_its_root_once_not_per_step(tmp_path, locate_calls):
    states = {step: make_state(step) for step in (1, 2)}
    with ckpt.CheckpointManager(str(tmp_path / "run"), interval=1) as manager:
        assert locate_calls == [str(tmp_path / "run")]
        for step, state in states.items():
            manager.save(step, state)
        live = blank_state()
        assert manager.load(live, 1) == 1
        assert manager.load(blank_state()) == 2
    assert_state_equal(live, states[1])
    assert locate_calls == [str(tmp_path / "run")]


def test_merge_resolves_its_source_and_destination_once_each(tmp_path, locate_calls):
    ckpt.save(make_state(4), tmp_path / "c", no_dist=True)
    locate_calls.clear()
    ckpt.convert.merge(str(tmp_path / "c"), str(tmp_path / "m.safetensors"), format="safetensors")
    assert locate_calls == [str(tmp_path / "c"), str(tmp_path / "m.safetensors")]
    assert (tmp_path / "m.safetensors").is_file()


def test_a_dcp_import_resolves_its_source_and_destination_once_each(tmp_path, locate_calls):
    source = save_small(tmp_path / "dcp")
    locate_calls.clear()
    ckpt.convert.import_dcp(source, tmp_path / "step-00000001")
    assert locate_calls == [source, tmp_path / "step-00000001"]
    assert ckpt.read_manifest(tmp_path / "step-00000001").step == 1
