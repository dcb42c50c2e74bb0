"""ckpt.save / ckpt.load in one process: bitwise round trips of every kind of state the engine accepts
(tensors of every dtype and shape, non-tensor values, RNG state, modules, optimizers, stateful objects,
compiled modules), several files per rank, and the manifest's step and user metadata."""

from __future__ import annotations

import random

import numpy as np
import torch

import ckpt
from tests.support import models

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]


def _tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape).clone()  # every bit pattern, NaN payloads included


def _zeroed(node):
    if isinstance(node, dict):
        return {k: _zeroed(v) for k, v in node.items()}
    if isinstance(node, torch.Tensor):
        return torch.zeros_like(node)
    return None if not isinstance(node, list) else [_zeroed(v) for v in node]


def test_plain_tensors_of_every_dtype_and_shape(tmp_path):
    state = {
        "tensors": {str(d).removeprefix("torch."): _tensor(d, (7, 5), i) for i, d in enumerate(DTYPES)},
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "big": _tensor(torch.float32, (300, 257), 99),  # > 64 KiB: 4 KiB-aligned in the file
        "view": torch.arange(100.0).reshape(10, 10)[:, 3],  # non-contiguous: stored as its values
        "nested": {"deeper": {"x": torch.arange(12).reshape(3, 4)}},
    }
    ckpt.save(state, tmp_path / "c")
    loaded = _zeroed(state)
    loaded["view"] = torch.zeros(10)
    ckpt.load(loaded, tmp_path / "c")
    expected = dict(state, view=state["view"].contiguous())
    models.assert_same(loaded, expected)
    big = ckpt.read_manifest(tmp_path / "c").tensors["big"].chunks[0].blob
    assert big.offset % 4096 == 0


def test_non_tensor_values(tmp_path):
    saved = {
        "step": 12345678901234567890,
        "lr": 3e-4,
        "nan": float("nan"),
        "inf": float("-inf"),
        "name": "llama-debug ✓",
        "flags": [True, None, 1.5, "x"],
        "betas": (0.9, 0.95),
        "int_keys": {1: "a", 2: ("b", 3)},
        "blob": b"\x00\xff raw",
        "dtype": torch.bfloat16,
        "array": np.arange(6, dtype=np.uint32).reshape(2, 3),
    }
    ckpt.save(saved, tmp_path / "c")
    loaded = {k: None for k in saved}
    ckpt.load(loaded, tmp_path / "c")
    array = loaded.pop("array")
    assert np.array_equal(array, saved["array"]) and array.dtype == np.uint32
    models.assert_same(loaded, {k: v for k, v in saved.items() if k != "array"})
    manifest = (tmp_path / "c" / "manifest.json").read_text()
    assert '"encoding":"json"' in manifest and "torch_save" not in manifest


def test_rng_state_restores_every_generator(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    ckpt.save({"rng": ckpt.RNGState()}, tmp_path / "c")
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    ckpt.load({"rng": ckpt.RNGState()}, tmp_path / "c")
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


class Counter:
    """Any object with state_dict/load_state_dict is checkpointed through them."""

    def __init__(self, n=0):
        self.n, self.history = n, torch.zeros(3)

    def state_dict(self):
        return {"n": self.n, "history": self.history}

    def load_state_dict(self, sd):
        self.n, self.history = sd["n"], sd["history"]


def test_module_optimizer_and_stateful_objects(tmp_path):
    model = models.build(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.5 ** s)
    models.train_step(model, optim)
    sched.step()
    counter = Counter(4)
    counter.history = torch.tensor([1.0, 2.0, 3.0])
    ckpt.save({"model": model, "optim": optim, "sched": sched, "counter": counter}, tmp_path / "c")

    model2 = models.build(seed=1)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(optim2, lambda s: 0.5 ** s)
    counter2 = Counter()
    ckpt.load({"model": model2, "optim": optim2, "sched": sched2, "counter": counter2}, tmp_path / "c")
    models.assert_same(models.full_state(model2, optim2), models.full_state(model, optim))
    assert sched2.state_dict()["last_epoch"] == 1 and counter2.n == 4
    assert torch.equal(counter2.history, torch.tensor([1.0, 2.0, 3.0]))
    # Training continues identically from the restored state.
    models.train_step(model, optim, seed=5)
    models.train_step(model2, optim2, seed=5)
    models.assert_same(models.full_state(model2, optim2), models.full_state(model, optim))


def test_compiled_module_keys_are_canonical(tmp_path):
    """A checkpoint must not depend on torch.compile: no ``_orig_mod.`` prefixes (torchtitan #961)."""
    model = models.build(seed=0)
    compiled = torch.compile(model, backend="eager")
    ckpt.save({"model": compiled}, tmp_path / "c")
    assert all("_orig_mod" not in key for key in ckpt.read_manifest(tmp_path / "c").tensors)
    plain = models.build(seed=4)
    ckpt.load({"model": plain}, tmp_path / "c")
    models.assert_same(plain.state_dict(), model.state_dict())


def test_many_files_per_rank(tmp_path):
    state = {f"t{i}": torch.randn(100, i + 1) for i in range(9)}
    ckpt.save(state, tmp_path / "c", files_per_rank=3)
    assert len(ckpt.read_manifest(tmp_path / "c").files) == 3
    loaded = _zeroed(state)
    ckpt.load(loaded, tmp_path / "c")
    models.assert_same(loaded, state)


def test_manifest_records_step_and_user_metadata(tmp_path):
    ckpt.save({"x": torch.ones(2)}, tmp_path / "c", step=100, user_metadata={"run": "abc"})
    manifest = ckpt.read_manifest(tmp_path / "c")
    assert (manifest.step, manifest.kind, manifest.user) == (100, "full", {"run": "abc"})
