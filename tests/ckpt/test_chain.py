"""ckpt.read.chain: one delta-chain walker, bounded by MAX_CHAIN, used by every loop over a chain —
the listing's chain check, retention, ckpt-copy, ``ckpt inspect --verify`` and a load's bases."""

from __future__ import annotations

import pytest
import ckpt
import ckpt.read.chain
from ckpt.errors import CorruptCheckpointError
from ckpt.inspect import verify_one
from ckpt.read import ChainLoopError, listed_base, walk
from ckpt.root import CheckpointRoot, steps_to_delete
from ckpt.storage import locate
from tests.support.chains import load_mixed, train_with_chain


def test_walk_follows_the_bases_and_refuses_a_loop_and_a_chain_too_long(monkeypatch):
    bases = {5: 4, 4: 2, 2: None, 9: 8, 8: 9, 7: "unreadable"}
    assert list(walk(5, listed_base(bases))) == [5, 4, 2]
    assert list(walk(7, listed_base(bases))) == [7] and list(walk(3, listed_base(bases))) == [3]
    with pytest.raises(ChainLoopError) as loop:
        list(walk(9, listed_base(bases)))
    assert loop.value.link == 9 and isinstance(loop.value, CorruptCheckpointError)
    monkeypatch.setattr(ckpt.read.chain, "MAX_CHAIN", 2)
    with pytest.raises(ChainLoopError, match="longer than 2 links"):
        list(walk(5, listed_base(bases)))


def test_every_walker_keeps_to_the_one_bound(tmp_path, monkeypatch):
    train_with_chain(tmp_path, steps=4, full_every=4)  # 1 full, 2-4 deltas: step 4's chain is 4 links
    monkeypatch.setattr(ckpt.read.chain, "MAX_CHAIN", 3)
    root = CheckpointRoot(tmp_path)
    assert root.steps() == [1, 2, 3]  # the listing never offers a chain longer than the bound
    path = locate(tmp_path) / "step-00000004"
    manifest = ckpt.read_manifest(path)
    [found] = verify_one(str(tmp_path), 4, path, manifest, lambda *_: None, [])  # ckpt inspect --verify
    assert "makes it longer than 3 links" in found["error"]
    three = path.parent / "step-00000003"
    assert verify_one(str(tmp_path), 3, three, ckpt.read_manifest(three), lambda *_: None, []) == []
    load_mixed(three)
    with pytest.raises(CorruptCheckpointError, match="loops"):  # a load's bases: the same rule
        load_mixed(path)
    with pytest.raises(ChainLoopError):
        steps_to_delete([1, 2, 3, 4], keep=1, bases={4: 3, 3: 2, 2: 1, 1: None})
    assert steps_to_delete([1, 2, 3, 4], keep=1, bases={4: 3, 3: 2, 2: None, 1: None}) == [1]
