"""ckpt.state_names: torch's names of a model's and optimizer's state, kept between saves. Each save
gives exactly torch's state dicts — fresh values (the learning rate a scheduler set, tensors a load put
in place, optimizer state made or replaced since) under names worked out again whenever what they
depend on changed — and a manager's saves round-trip bitwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import ckpt.state_names as state_names
from ckpt.manager import CheckpointManager
from ckpt.state import export_state
from ckpt.state_names import FLAT, StateNames


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))})


def _train(model: nn.Module, optim: torch.optim.Optimizer, seed: int = 0) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
    model["b"](model["a"](x)).square().sum().backward()
    optim.step()
    optim.zero_grad()


def _same(mine: dict, torchs: dict) -> None:
    """The same keys in the same order; tensors with the same bytes and storage, other values equal."""
    assert list(mine) == list(torchs)
    for key, value in torchs.items():
        if isinstance(value, torch.Tensor):
            assert mine[key].data_ptr() == value.data_ptr() and torch.equal(mine[key], value), key
        else:
            assert mine[key] == value, key


def _check(names: StateNames, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    names.new_export()
    _same(names.model_state_dict(model), get_model_state_dict(model))
    _same(names.optimizer_state_dict(model, optim), get_optimizer_state_dict(model, optim, options=FLAT))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, StateNames]:
    """A model and AdamW after one step, and names checked against torch's once."""
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim)
    names = StateNames()
    _check(names, model, optim)
    return model, optim, names


@pytest.fixture
def torch_calls(monkeypatch) -> list[str]:
    """Which of torch's functions the kept names still call."""
    calls: list[str] = []
    for name in ("get_model_state_dict", "get_optimizer_state_dict"):
        real = getattr(state_names, name)
        monkeypatch.setattr(state_names, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    return calls


def test_names_are_worked_out_once_and_every_save_is_torchs(torch_calls):
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim)
    names = StateNames()
    for seed in range(3):
        _check(names, model, optim)
        _train(model, optim, seed)
    assert torch_calls == ["get_model_state_dict", "get_optimizer_state_dict"]


@pytest.mark.parametrize("wrap", ["model", "block"])
def test_compiled_models_keep_torchs_names(wrap, torch_calls):
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if wrap == "model":  # keys "_orig_mod.a.weight", names "a.weight" (never called: nothing compiles)
        wrapped = torch.compile(model)
    else:  # the trainer's way: "a._orig_mod.weight" named "a.weight", moved after the others
        wrapped = nn.ModuleDict({"a": torch.compile(model["a"]), "b": model["b"]})
    _train(model, optim)
    assert list(wrapped.state_dict()) != list(get_model_state_dict(wrapped))  # torch renames keys here
    names = StateNames()
    for seed in range(2):
        _check(names, wrapped, optim)
        _train(model, optim, seed)
    assert len(torch_calls) == 2
    model["a"].register_buffer("seen", torch.ones(4))  # a new key to rename: "..._orig_mod.seen"
    _check(names, wrapped, optim)
    assert len(torch_calls) == 3


def test_a_save_after_the_lr_changes_records_the_new_lr():
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1 / (step + 1))
    _train(model, optim)
    names = StateNames()
    state = {"model": model, "optim": optim}
    saved = []
    for _ in range(4):
        saved.append(export_state(state, names=names)[0]["optim"]["param_groups.b.1.bias.lr"])
        scheduler.step()
    assert saved == [0.1, 0.1 / 2, 0.1 / 3, 0.1 / 4]


def test_a_save_after_a_load_sees_the_loaded_tensors():
    model, optim, names = _trained()
    other_model = _model(seed=1)
    other = torch.optim.AdamW(other_model.parameters(), lr=0.1)
    _train(other_model, other, seed=5)
    optim.load_state_dict(other.state_dict())  # new state tensors, cast and copied
    model.load_state_dict(other_model.state_dict())  # in place
    _check(names, model, optim)
    names.new_export()
    loaded = names.optimizer_state_dict(model, optim)
    assert loaded["state.a.weight.exp_avg"] is optim.state[optim.param_groups[0]["params"][0]]["exp_avg"]
    assert torch.equal(loaded["state.a.weight.exp_avg"], other.state[other.param_groups[0]["params"][0]]["exp_avg"])
    model.load_state_dict(_model(seed=2).state_dict(), assign=True)  # new parameter objects
    names.new_export()
    _same(names.model_state_dict(model), get_model_state_dict(model))
    assert torch.equal(names.model_state_dict(model)["a.weight"], _model(seed=2)["a"].weight)


def test_a_save_after_the_optimizer_state_was_replaced_sees_the_new_tensors():
    model, optim, names = _trained()
    weight = model["a"].weight
    optim.state[weight]["exp_avg"] = replaced = torch.full_like(weight, 7.0)
    del optim.state[model["b"][1].bias]  # and a state gone
    _check(names, model, optim)
    names.new_export()
    assert names.optimizer_state_dict(model, optim)["state.a.weight.exp_avg"] is replaced
    optim.state.clear()  # torch makes it again (a step with lr 0): no state, no kept names
    _check(names, model, optim)


def test_state_made_at_the_first_step_is_saved():
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    names = StateNames()
    names.new_export()
    names.model_state_dict(model)
    before = names.optimizer_state_dict(model, optim)  # torch initialises the state (a step with lr 0)
    assert "state.a.weight.exp_avg" in before
    _train(model, optim)
    _check(names, model, optim)


def test_names_follow_modules_swapped_a_param_group_added_and_a_buffer_registered(torch_calls):
    model = _model()
    model["c"] = nn.Linear(4, 2)
    optim = torch.optim.AdamW([*model["a"].parameters(), *model["b"].parameters()], lr=0.1)
    _train(model, optim)
    names = StateNames()
    _check(names, model, optim)
    model["a"], model["b"][0] = model["b"][0], model["a"]  # the same parameter objects under other names
    _check(names, model, optim)
    optim.add_param_group({"params": list(model["c"].parameters()), "lr": 0.5})
    _check(names, model, optim)
    optim.param_groups[0]["params"].reverse()  # the same parameters at other positions
    _check(names, model, optim)
    model["b"][1].register_buffer("seen", torch.ones(3))
    _check(names, model, optim)
    assert torch_calls.count("get_model_state_dict") == 3 and torch_calls.count("get_optimizer_state_dict") == 4


def test_a_parameter_replaced_outside_the_optimizer_fails_as_torch_does():
    model, optim, names = _trained()
    model["a"].weight = nn.Parameter(torch.zeros(4, 4))  # the optimizer still holds the old one
    with pytest.raises(KeyError):
        get_optimizer_state_dict(model, optim, options=FLAT)
    names.new_export()
    with pytest.raises(KeyError):
        names.optimizer_state_dict(model, optim)


def test_a_managers_saves_round_trip_bitwise(tmp_path):
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1 / (step + 1))
    with CheckpointManager(tmp_path, interval=1, keep=5, async_mode="double_buffer") as manager:
        manager.attach(optim, model=model)
        for step in (1, 2, 3):
            _train(model, optim, step)
            scheduler.step()
            manager.save(step, {"model": model, "optim": optim, "lr_scheduler": scheduler})
        manager.wait()
        saved_model, saved_optim = model.state_dict(), optim.state_dict()
        fresh_model = _model(seed=9)
        fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1.0)
        fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 1 / (step + 1))
        assert manager.load({"model": fresh_model, "optim": fresh, "lr_scheduler": fresh_scheduler}) == 3
    for key, value in saved_model.items():
        assert torch.equal(fresh_model.state_dict()[key], value), key
    loaded = fresh.state_dict()
    assert loaded["param_groups"][0]["lr"] == saved_optim["param_groups"][0]["lr"] == 0.1 / 4
    for i, state in saved_optim["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["state"][i][key], value), (i, key)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


@pytest.mark.parametrize("differs", ["names", "values"])
def test_a_naming_that_does_not_give_torchs_result_is_not_kept(monkeypatch, differs):
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train(model, optim)
    # as if torch gave other names, or other values, than the names kept here would: torch's, every save
    if differs == "names":
        def other(key, value):
            return f"x.{key}", value
    else:
        def other(key, value):
            return key, value.clone() if isinstance(value, torch.Tensor) else value
    for name in ("get_model_state_dict", "get_optimizer_state_dict"):
        real = getattr(state_names, name)
        monkeypatch.setattr(state_names, name, lambda *a, _real=real, **k: dict(other(*i) for i in _real(*a, **k).items()))
    names = StateNames()
    live = optim.state[model["a"].weight]["exp_avg"]
    for _ in range(2):
        names.new_export()
        model_state = names.model_state_dict(model)
        optimizer_state = names.optimizer_state_dict(model, optim)
        if differs == "names":
            assert all(key.startswith("x.") for key in [*model_state, *optimizer_state])
        else:
            assert optimizer_state["state.a.weight.exp_avg"] is not live
