"""ckpt.convert.merged: one consolidated safetensors file, published atomically; a failure on the writing
rank is raised on every rank as the same typed error."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

import ckpt
from tests.support.launch import run_ranks


def test_merged_file_round_trip_overwrite_and_stale_tmp(tmp_path):
    path = tmp_path / "model.safetensors"
    stale = tmp_path / "model.safetensors.tmp-0123456789ab"
    stale.write_bytes(b"half a file")
    state = {"w": torch.randn(8, 4), "step": 3}
    ckpt.save(state, path, merged=True)
    assert not stale.exists()
    assert torch.equal(safetensors.torch.load_file(path)["w"], state["w"])
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save({"w": torch.zeros(8, 4)}, path, merged=True)
    assert torch.equal(safetensors.torch.load_file(path)["w"], state["w"])  # untouched
    ckpt.save({"w": torch.zeros(8, 4)}, path, merged=True, overwrite=True)
    assert torch.equal(safetensors.torch.load_file(path)["w"], torch.zeros(8, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_value_json_cannot_hold_is_refused_in_a_merged_file(tmp_path):
    with pytest.raises(ckpt.UnsupportedFormatError, match="JSON only"):
        ckpt.save({"w": torch.zeros(2), "seen": {1, 2}}, tmp_path / "m.safetensors", merged=True)
    assert list(tmp_path.iterdir()) == []


def _merged_onto_existing(rank: int, world: int, path: str):
    try:
        ckpt.save({"w": torch.full((4,), float(rank))}, path, merged=True)
    except ckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.slow
def test_a_failure_on_the_writing_rank_is_raised_on_every_rank(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"already here")
    errors = run_ranks(2, _merged_onto_existing, str(path))
    assert errors[0] == errors[1] and errors[0][0] == "CheckpointExistsError"
    assert path.read_bytes() == b"already here"
