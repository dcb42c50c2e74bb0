"""Every rank of one load reads the same checkpoint: ranks that opened different ones (rank-dependent
paths, a step committed between two ranks' reads) fail together, before a byte is loaded.

DCP's coordinator sees every rank's plan (``ckpt.dcp.Reader.prepare_global_plan``); each plan names
the manifest digest of the checkpoint its rank opened. Two ranks loading two steps of one model (the
same keys and shapes, so nothing else tells them apart) used to both succeed, each with its own
step's tensors in one job's state.
"""

from __future__ import annotations

import pytest
import torch

import ckpt
from tests.support.launch import run_ranks


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "step": seed}


def _load_own_step(rank: int, world: int, root: str):
    ckpt.save(_state(10), f"{root}/step-1", step=1)
    ckpt.save(_state(20), f"{root}/step-2", step=2)
    live = _state(99)
    before = {k: v.clone() for k, v in live.items() if isinstance(v, torch.Tensor)}
    try:
        ckpt.load(live, f"{root}/step-{rank + 1}")  # rank 0 opens step 1, rank 1 step 2
    except ckpt.CheckpointError as exc:
        untouched = all(torch.equal(live[k], before[k]) for k in before) and live["step"] == 99
        return type(exc).__name__, str(exc), untouched
    return "loaded", None, None


@pytest.mark.slow  # 2 gloo ranks
def test_ranks_loading_different_checkpoints_fail_on_every_rank(tmp_path):
    results = run_ranks(2, _load_own_step, str(tmp_path))
    assert [r[0] for r in results] == ["CheckpointError"] * 2, results
    for _, message, untouched in results:
        assert "opened different checkpoints" in message and "step-1" in message and "step-2" in message
        assert untouched


def _load_same_step(rank: int, world: int, root: str):
    ckpt.save(_state(10), f"{root}/step-1", step=1)
    live = _state(99)
    ckpt.load(live, f"{root}/step-1")
    return torch.equal(live["w"], _state(10)["w"]) and live["step"] == 10


@pytest.mark.slow  # 2 gloo ranks
def test_ranks_loading_one_checkpoint_agree(tmp_path):
    assert run_ranks(2, _load_same_step, str(tmp_path)) == [True, True]
