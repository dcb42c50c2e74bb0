"""Resolve once at the door (issue 37 item 3e): a public entry point turns a path or URL into a
:class:`~ckpt.storage.Location` once and passes it inward; nothing inside calls ``locate`` again.

Counted by wrapping every binding of :func:`ckpt.storage.locate` in the engine's modules."""

from __future__ import annotations

import sys

import pytest

import ckpt
import ckpt.storage
from tests.support.checkpoints import assert_state_equal, blank_state, make_state


@pytest.fixture
def locate_calls(monkeypatch) -> list:
    calls, real = [], ckpt.storage.locate

    def counted(target, *args, **kwargs):
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
