"""ckpt.write.assemble: the one manifest builder — a header from the delta base, entries from (key, dtype,
shape) — and a checkpoint written by one process committed whole or not at all."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.write.assemble import NewCheckpoint, new_manifest
from ckpt.write.delta import DeltaBase
from ckpt.format import ValueEntry
from ckpt.storage import locate
from ckpt.write.files import Payload, Place, tensor_bytes


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_new_manifest_header_and_entries():
    full = new_manifest([("w", torch.float32, [2, 3])], step=4, world_size=2, user={"a": 1}, paths={"w": ("w",)})
    assert (full.kind, full.base_step, full.base, full.world_size, full.step) == ("full", None, None, 2, 4)
    assert full.created > 0 and full.user == {"a": 1} and full.paths == {"w": ("w",)}
    assert full.tensors["w"].shape == (2, 3) and full.tensors["w"].chunks == []
    delta = new_manifest([], step=5, world_size=1, base=DeltaBase(4, "step-00000004", {}), created=12.5)
    assert (delta.kind, delta.base_step, delta.base, delta.created) == ("delta", 4, "step-00000004", 12.5)


def test_a_new_checkpoint_is_committed_whole_and_loads(tmp_path):
    weight = torch.randn(4, 3)
    manifest = new_manifest([("w", weight.dtype, weight.shape)], step=1, world_size=1, paths={"w": ("w",)})
    manifest.add_record("note", ValueEntry("json", value="hello"))
    with NewCheckpoint(locate(tmp_path / "c"), manifest, overwrite=False) as new:
        new.write(new.data_file(0), [Payload(Place("w", (0, 0), (4, 3)), lambda: tensor_bytes(weight), 48)])
    assert _leftovers(tmp_path) == ["c"]
    live = {"w": torch.zeros(4, 3), "note": None}
    ckpt.load(live, tmp_path / "c", no_dist=True)
    assert torch.equal(live["w"], weight) and live["note"] == "hello"


def test_a_failed_or_unreadable_new_checkpoint_leaves_nothing(tmp_path):
    def boom():
        raise OSError("the source went away")

    manifest = new_manifest([("w", torch.float32, (4,))], step=1, world_size=1)
    with pytest.raises(OSError, match="went away"):
        with NewCheckpoint(locate(tmp_path / "c"), manifest, overwrite=False) as new:
            new.write(new.data_file(0), [Payload(Place("w", (0,), (4,)), boom, 16)])
    assert _leftovers(tmp_path) == []

    # a chunk that does not cover its tensor: refused by the check, never published
    manifest = new_manifest([("w", torch.float32, (4,))], step=1, world_size=1)
    with pytest.raises(ckpt.InvalidManifestError):
        with NewCheckpoint(locate(tmp_path / "c"), manifest, overwrite=False, check="a test") as new:
            new.write(new.data_file(0), [Payload(Place("w", (0,), (2,)), lambda: tensor_bytes(torch.ones(2)), 8)])
    assert _leftovers(tmp_path) == []
