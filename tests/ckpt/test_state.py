"""ckpt.state: an optimizer's hyper-parameters are saved per parameter, so ranks whose optimizers hold
different parameters (pipeline stages) each get their own groups back; checkpoints that stored
``param_groups`` whole still load."""

from __future__ import annotations

import json

import pytest
import torch

import ckpt
from tests.support.launch import run_ranks


def _stage(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One pipeline stage: each rank holds other layers (other parameter names) with its own lr."""
    torch.manual_seed(rank)
    model = torch.nn.ModuleDict({f"layer{rank}": torch.nn.Linear(4, 4)})
    return model, torch.optim.AdamW(model.parameters(), lr=0.1 * (rank + 1), betas=((0.8, 0.85)[rank], 0.9))


def _save_and_load_stages(rank: int, world: int, path: str) -> tuple[float, tuple, bool]:
    model, optim = _stage(rank)
    model[f"layer{rank}"](torch.ones(2, 4)).sum().backward()
    optim.step()
    ckpt.save({"model": model, "optim": optim}, path)
    expected = optim.state_dict()
    fresh_model, fresh = _stage(rank)
    for group in fresh.param_groups:
        group["lr"], group["betas"] = 1.0, (0.5, 0.5)
    ckpt.load({"model": fresh_model, "optim": fresh}, path)
    loaded = fresh.state_dict()
    same_moments = all(torch.equal(loaded["state"][i]["exp_avg"], expected["state"][i]["exp_avg"])
                       for i in expected["state"])
    fresh_model[f"layer{rank}"](torch.ones(2, 4)).sum().backward()
    fresh.step()  # a group that lost its hyper-parameters fails here (KeyError: 'betas')
    return fresh.param_groups[0]["lr"], tuple(fresh.param_groups[0]["betas"]), same_moments


@pytest.mark.slow
def test_pipeline_stages_each_load_their_own_optimizer_groups(tmp_path):
    results = run_ranks(2, _save_and_load_stages, str(tmp_path / "step"))
    assert results == [(0.1, (0.8, 0.9), True), (0.2, (0.85, 0.9), True)]


def test_a_checkpoint_that_stored_param_groups_whole_still_loads(tmp_path):
    model, optim = _stage(0)
    model["layer0"](torch.ones(2, 4)).sum().backward()
    optim.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    # the layout saved before: one param_groups value (a plain dict is saved as it is)
    ckpt.save({"model": model, "optim": get_optimizer_state_dict(model, optim)}, tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    assert "optim.param_groups" in manifest["values"]
    fresh_model, fresh = _stage(0)
    for group in fresh.param_groups:
        group["lr"] = 1.0
    ckpt.load({"model": fresh_model, "optim": fresh}, tmp_path / "old")
    assert fresh.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])


def test_new_saves_store_the_groups_per_parameter(tmp_path):
    model, optim = _stage(0)
    ckpt.save({"model": model, "optim": optim}, tmp_path / "new")
    values = json.loads((tmp_path / "new" / "manifest.json").read_text())["values"]
    assert "optim.param_groups" not in values
    assert values["optim.param_groups.layer0.weight.lr"]["value"] == 0.1
