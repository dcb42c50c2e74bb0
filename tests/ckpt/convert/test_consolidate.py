"""ckpt.convert.consolidate: tensor keys chosen (all, a group, a prefix), described from the manifest
alone, and assembled whole, one at a time, floats converted on the way (bitwise otherwise)."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.convert import TensorSpec, full_tensors, select_keys, tensor_specs
from tests.support import models
from tests.support.checkpoints import mixed_dtype_state


def test_select_keys_tensor_specs_and_full_tensors(tmp_path):
    state = mixed_dtype_state()
    ckpt.save(state, tmp_path / "c")
    manifest = ckpt.read_manifest(tmp_path / "c")
    assert select_keys(manifest, "model") == sorted(f"model.{k}" for k in state["model"])
    assert select_keys(manifest, "optim.m") == ["optim.m"]
    assert select_keys(manifest, None) == sorted(manifest.tensors)
    with pytest.raises(ckpt.CheckpointError, match="model.layers"):
        select_keys(manifest, "model.layers.")
    specs = tensor_specs(manifest, ["model.i", "model.a"], dtype=torch.bfloat16)
    assert specs == [TensorSpec("model.a", torch.bfloat16, (5, 3)), TensorSpec("model.i", torch.int32, (4,))]
    got = dict(full_tensors(tmp_path / "c", ["model.i", "model.a"], dtype=torch.bfloat16))
    assert list(got) == ["model.i", "model.a"]
    models.assert_same(got, {"model.i": state["model"]["i"], "model.a": state["model"]["a"].to(torch.bfloat16)})
