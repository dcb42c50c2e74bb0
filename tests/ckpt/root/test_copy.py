"""ckpt.root.copy: one committed step copied to another mount, every blob verified as it streams;
corruption on the source is never committed, a read-back finds what the target damaged."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt
from ckpt.root import CheckpointRoot, copy_step
from ckpt.root import copy as root_copy
from ckpt.storage import locate
from tests.support.replicas import state as _state


def test_corruption_on_the_source_is_never_replicated(tmp_path):
    ckpt.save(_state(1), tmp_path / "a" / "step-00000001")
    data = tmp_path / "a" / "step-00000001" / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        copy_step(locate(tmp_path / "a" / "step-00000001"), locate(tmp_path / "b" / "step-00000001"))
    assert info.value.file == "data/rank-00000.bin" and info.value.tensor in ("w", "b")
    assert CheckpointRoot(tmp_path / "b").committed() == [] and not any((tmp_path / "b").iterdir())


def test_read_back_finds_what_the_replica_damaged(tmp_path, monkeypatch):
    ckpt.save(_state(1), tmp_path / "a" / "step-00000001")
    copy = root_copy.copy_file

    def copy_then_damage(source, target, name, blobs, size=None):
        written = copy(source, target, name, blobs, size)
        damaged = Path((target / name).path)
        raw = bytearray(damaged.read_bytes())
        raw[-1] ^= 0x01  # the replica's mount flips a bit after the write reported success
        damaged.write_bytes(bytes(raw))
        return written

    monkeypatch.setattr(root_copy, "copy_file", copy_then_damage)
    source = locate(tmp_path / "a" / "step-00000001")
    copy_step(source, locate(tmp_path / "b" / "step-00000001"))  # without read-back: committed as written
    assert CheckpointRoot(tmp_path / "b").committed() == [1]
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        copy_step(source, locate(tmp_path / "c" / "step-00000001"), read_back=True)
    assert info.value.file == "data/rank-00000.bin" and info.value.tensor in ("w", "b")
    assert CheckpointRoot(tmp_path / "c").committed() == []
