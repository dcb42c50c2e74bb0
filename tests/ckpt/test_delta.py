"""Incremental checkpoints through CheckpointManager: lossless deltas at every link of a chain, a layout
change forces a full, a broken link is named and the manager falls back past it."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckpt
from ckpt.manager import CheckpointManager
from tests.support.checkpoints import step_path
from tests.support import models
from tests.support.chains import Mixed
from tests.support.chains import expected_state as _expected
from tests.support.chains import load_mixed as _load
from tests.support.chains import train_with_chain as _train_with_chain


def test_every_link_of_a_chain_loads_bitwise(tmp_path):
    expected = _train_with_chain(tmp_path, full_every=4)
    kinds = [ckpt.read_manifest(step_path(tmp_path, s)).kind for s in range(1, 10)]
    assert kinds == ["full", "delta", "delta", "delta"] * 2 + ["full"]
    assert ckpt.read_manifest(step_path(tmp_path, 3)).base_step == 2
    for step, want in expected.items():
        models.assert_same(_load(step_path(tmp_path, step)), want, f"step {step}")
    full = sum(ckpt.read_manifest(step_path(tmp_path, 1)).files.values())
    delta = sum(ckpt.read_manifest(step_path(tmp_path, 2)).files.values())
    assert delta < 0.8 * full  # lossless, and still smaller (real ratios: benchmarks/RESULTS.md)


def test_layout_change_forces_a_full(tmp_path):
    with CheckpointManager(tmp_path, interval=1, keep=10, full_every=10) as manager:
        for step in range(1, 5):
            rows = 4 if step < 3 else 5  # the tensor grows at step 3
            manager.save(step, {"x": torch.full((rows, 3), float(step)), "bf": torch.ones(7, dtype=torch.bfloat16)})
    kinds = [ckpt.read_manifest(step_path(tmp_path, s)).kind for s in range(1, 5)]
    assert kinds == ["full", "delta", "full", "delta"]
    out = {"x": torch.zeros(5, 3), "bf": torch.zeros(7, dtype=torch.bfloat16)}
    ckpt.load(out, step_path(tmp_path, 4))
    assert torch.equal(out["x"], torch.full((5, 3), 4.0))


def test_broken_link_is_named_and_manager_falls_back(tmp_path):
    expected = _train_with_chain(tmp_path, steps=4, full_every=4)
    shutil.rmtree(step_path(tmp_path, 2))
    with pytest.raises(ckpt.CorruptCheckpointError, match="step-00000002"):
        _load(step_path(tmp_path, 4))
    # corrupt link: a flipped byte inside step 3's data is named too
    other = tmp_path / "other"
    _train_with_chain(other, steps=4, full_every=4)
    data = step_path(other, 3) / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(raw)
    with pytest.raises(ckpt.CorruptCheckpointError, match="step-00000003"):
        _load(step_path(other, 4))
    model = Mixed()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": 0}
    with CheckpointManager(tmp_path) as manager, pytest.warns(UserWarning, match="falling back"):
        assert manager.load(state) == 1  # 4 and 3 need the deleted step 2; 1 is a full
    models.assert_same(_expected(model, optim, state["step"]), expected[1])


def test_a_damaged_delta_chunk_names_its_tensor_and_file_plainly(tmp_path):
    _train_with_chain(tmp_path, steps=2, full_every=2)
    path = step_path(tmp_path, 2)
    manifest = ckpt.read_manifest(path)
    key, chunk = next((k, c) for k, e in sorted(manifest.tensors.items()) for c in e.chunks
                      if c.blob.codec == "delta" and c.blob.length > 64)
    data = path / chunk.blob.file
    raw = bytearray(data.read_bytes())
    raw[chunk.blob.offset + 3] ^= 0x10
    data.write_bytes(raw)
    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        _load(path)
    assert (info.value.tensor, info.value.file, info.value.path) == (key, chunk.blob.file, str(path))


def test_the_delta_chain_tells_what_each_step_in_flight_builds_on():
    """The one owner of the save path's delta state (what the root used to be told as well): a
    delta's base while it is written, none once its write ended, and a delta queued on a base whose
    write failed is stored whole; the next save after a failure is a full."""
    from concurrent.futures import Future

    from ckpt.format import step_name
    from ckpt.write import DeltaChain, Target

    def at(step):
        return Target(step, step, write=None, name=step_name(step))

    chain = DeltaChain(full_every=3)
    staged = Future()
    staged.set_result({"w": torch.zeros(2)})
    signature = ((2,), torch.float32)
    assert not chain.eligible(at(4), signature)  # nothing to build on yet
    assert chain.started(at(4), staged, signature, delta=False) is None
    assert chain.eligible(at(5), signature) and not chain.eligible(at(5), ((3,), torch.float32))
    assert not chain.eligible(at(4), signature)  # never a delta of itself
    assert chain.started(at(5), staged, signature, delta=True) == 4
    assert chain.bases_in_flight() == {4: None, 5: 4}
    chain.finished(4, failed=True)  # step 5 was queued on it
    assert chain.base_for(5) is None and chain.bases_in_flight() == {5: None}
    assert not chain.eligible(at(6), signature)  # after a failed write: a full
    chain.finished(5, failed=False)
    assert chain.bases_in_flight() == {}
    chain.started(at(6), staged, signature, delta=False)
    chain.started(at(7), staged, signature, delta=True)
    base = chain.base_for(7)
    assert base.step == 6 and base.name == "step-00000006" and torch.equal(base.state["w"], torch.zeros(2))
