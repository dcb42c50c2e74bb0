"""Resharding across layouts, bitwise: FSDP2xTP on 4 ranks <-> FSDP2 on 2 ranks <-> one process.

Tensors have uneven shards (vocab 13 over 2 and 4). A layout's training step produces the state;
its full (gathered) tensors are the reference every other layout must load exactly.
"""

from __future__ import annotations

import pytest
import torch

import ckpt
from tests.support import models
from tests.support.launch import run_ranks
from tests.support.parallel import save_parallel

pytestmark = pytest.mark.slow  # every test here spawns 2 and 4 ranks several times


def _load_parallel(rank: int, world: int, layout: str, source: str):
    model = models.parallelize(models.build(seed=5), layout)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": 0, "meta": {"layout": None}}
    ckpt.load(state, source + "/ckpt")
    models.assert_same(models.full_state(model, optim), torch.load(source + "/expected.pt"))
    return state["step"], state["meta"]


def _single_process_reference(root) -> str:
    model = models.build(seed=3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    models.train_step(model, optim)
    ckpt.save({"model": model, "optim": optim, "step": 1}, root / "single" / "ckpt")
    torch.save(models.full_state(model, optim), root / "single" / "expected.pt")
    return str(root / "single")


def _load_single_process(source: str):
    model = models.build(seed=9)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": 0}
    ckpt.load(state, source + "/ckpt", strict=False)  # strict=False: ignore the saver's "meta"
    models.assert_same(models.full_state(model, optim), torch.load(source + "/expected.pt"))
    return state


def test_reshard_1_to_4_to_2_to_1(tmp_path):
    import safetensors.torch

    single = _single_process_reference(tmp_path)
    four = tmp_path / "four"
    # 1 -> 4 (FSDP2 x TP on a 2x2 mesh), then 4 ranks train a step and save their own checkpoint.
    files = run_ranks(4, save_parallel, "fsdp_tp", str(four), str(tmp_path / "merged.safetensors"), single)
    assert files[0] == [f"rank-0000{r}.bin" for r in range(4)]

    # 4 -> 2 (FSDP2 over 2 ranks), which then saves in its own layout.
    results = run_ranks(2, _load_parallel, "fsdp", str(four))
    assert results == [(2, {"layout": "fsdp_tp"})] * 2

    # 4 -> 1 (plain model in this process).
    state = _load_single_process(str(four))
    assert state["step"] == 2

    # The merged safetensors file equals the sharded checkpoint's full tensors.
    merged = safetensors.torch.load_file(tmp_path / "merged.safetensors")
    expected = torch.load(four / "expected.pt")["model"]
    models.assert_same(merged, {f"model.{k}": v for k, v in expected.items()})


def test_reshard_2_to_1_and_back_to_4(tmp_path):
    two = tmp_path / "two"
    run_ranks(2, save_parallel, "fsdp", str(two), None, None)
    _load_single_process(str(two))  # 2 -> 1
    run_ranks(4, _load_parallel, "fsdp_tp", str(two))  # 2 -> 4 (FSDP2 x TP)
