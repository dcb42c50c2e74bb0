"""Incremental checkpoints: lossless deltas at every link of a chain, layout changes, broken links,
chain-aware retention, zstd fulls, and ckpt-replay."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ckpt
from ckpt import codec, retention
from ckpt.manager import CheckpointManager, committed_steps, step_path
from ckpt.replay import materialize
from tests import models

CODEC_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                torch.int16, torch.uint8, torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CODEC_DTYPES), st.integers(0, 300), st.integers(0, 2**32 - 1), st.floats(0, 1))
def test_codecs_round_trip_every_bit_pattern(dtype, n, seed, change):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    current = base.copy()
    flip = rng.random(current.size) < change
    current[flip] = rng.integers(0, 256, int(flip.sum()), dtype=np.uint8)
    for encoded, reference in ((codec.encode_delta(current, base, dtype.itemsize, 1), base),
                               (codec.encode_planes(current, dtype.itemsize, 1), None)):
        decoded = codec.decode(encoded.codec, encoded.data, raw_length=current.nbytes, itemsize=dtype.itemsize,
                               planes=encoded.planes, base=reference)
        assert np.array_equal(decoded, current)


class Mixed(nn.Module):
    """fp32 weights (AdamW) plus bf16, fp16 and integer state that changes every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.register_buffer("ema_bf16", torch.zeros(64, 256, dtype=torch.bfloat16))
        self.register_buffer("scale_fp16", torch.ones(256, dtype=torch.float16))
        self.register_buffer("counts", torch.zeros(64, dtype=torch.int64))

    def train_step(self, optim, step: int) -> None:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        self.net(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            self.ema_bf16.mul_(0.9).add_(self.net[0].weight.T.to(torch.bfloat16), alpha=0.1)
            self.scale_fp16.add_(0.01)
            self.counts[step % 64] += step


def _expected(model, optim, step) -> dict:
    return {**models.full_state(model, optim), "step": step}


def _load(path, step_hint=0) -> dict:
    model = Mixed()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": step_hint}
    ckpt.load(state, path)
    return _expected(model, optim, state["step"])


def _train_with_chain(root, steps=9, **manager_args):
    model = Mixed()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = {}
    with CheckpointManager(root, interval=1, **{"keep": 100, **manager_args}) as manager:
        manager.attach(optim)
        for step in range(1, steps + 1):
            model.train_step(optim, step)
            expected[step] = _expected(model, optim, step)
            manager.save(step, {"model": model, "optim": optim, "step": step})
    return expected


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


def test_zstd_full_checkpoints(tmp_path):
    expected = _train_with_chain(tmp_path, steps=2, compress="zstd")
    manifest = ckpt.read_manifest(step_path(tmp_path, 2))
    assert manifest.kind == "full" and {c.blob.codec for e in manifest.tensors.values() for c in e.chunks} == {"planes"}
    models.assert_same(_load(step_path(tmp_path, 2)), expected[2])


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


def test_retention_keeps_what_retained_deltas_need(tmp_path):
    assert retention.steps_to_delete([1, 2, 3, 4, 5], keep=1, bases={2: 1, 3: 2, 4: None, 5: 4}) == [1, 2, 3]
    assert retention.steps_to_delete([1, 2, 3], keep=1, bases={2: 1, 3: 2}) == []
    _train_with_chain(tmp_path, steps=6, full_every=3)  # 1 full, 2-3 deltas, 4 full, 5-6 deltas
    with CheckpointManager(tmp_path, keep=1) as manager:
        manager.save(7, {"x": torch.ones(1)}, force=True)  # a full of another layout triggers retention
    assert committed_steps(tmp_path) == [7]
    _train_with_chain(tmp_path / "b", steps=5, full_every=3, keep=1)
    assert committed_steps(tmp_path / "b") == [4, 5]  # 5 is a delta on 4


def test_replay_equals_the_chain(tmp_path):
    expected = _train_with_chain(tmp_path, steps=4, full_every=4)
    out = tmp_path / "replayed"
    result = subprocess.run([sys.executable, "-m", "tools.replay", str(tmp_path), "--step", "4", "--out", str(out),
                             "--quiet"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    manifest = ckpt.read_manifest(out)
    assert manifest.kind == "full" and manifest.base is None
    assert {c.blob.codec for e in manifest.tensors.values() for c in e.chunks} == {"raw"}
    models.assert_same(_load(out), expected[4])
    # In place: step 3 becomes a full; step 4 (a delta on 3) still loads.
    materialize(step_path(tmp_path, 3))
    assert ckpt.read_manifest(step_path(tmp_path, 3)).kind == "full"
    models.assert_same(_load(step_path(tmp_path, 3)), expected[3])
    models.assert_same(_load(step_path(tmp_path, 4)), expected[4])


def test_replay_cli_errors(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tools.replay", str(tmp_path), "--step", "9"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "no checkpoint" in result.stderr
    result = subprocess.run([sys.executable, "-m", "tools.replay", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
