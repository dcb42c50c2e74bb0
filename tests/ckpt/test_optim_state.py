"""ckpt.optim_state: Adam/AdamW's empty state made directly is torch's zero-gradient step's, bit for bit,
and every case it does not take is left to torch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

from ckpt.optim_state import create_empty_state
from tests.support.launch import run_ranks
from tests.support.models import assert_same


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3, bias=False))
    model[1].bias.requires_grad_(False)  # a frozen parameter: no state for it
    return model


def _groups(model: torch.nn.Module) -> list[dict]:
    decay, rest = [model[0].weight, model[2].weight], [model[0].bias, *model[1].parameters()]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 3e-4}]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if type(a) is not type(b) or a.dtype != b.dtype or a.device != b.device or a.shape != b.shape:
        return False
    if hasattr(a, "placements"):
        if a.placements != b.placements or a.device_mesh != b.device_mesh:
            return False
        a, b = a.to_local(), b.to_local()
    return a.stride() == b.stride() and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def _assert_as_torch(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, ours_model, theirs_model) -> None:
    mine, torchs = ours.state_dict(), theirs.state_dict()
    assert mine["param_groups"] == torchs["param_groups"]
    assert list(mine["state"]) == list(torchs["state"]) and mine["state"]  # the same parameters, in order
    for index, state in torchs["state"].items():
        assert list(mine["state"][index]) == list(state)
        for key, value in state.items():
            assert _same_bits(mine["state"][index][key], value), (index, key)
    for p, q in zip(ours_model.parameters(), theirs_model.parameters()):
        assert _same_bits(p.detach(), q.detach()) and p.grad is None and q.grad is None


CASES = {
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}),
    "adamw-foreach-amsgrad": (torch.optim.AdamW, {"weight_decay": 0.1, "foreach": True, "amsgrad": True}),
    "adamw-single-maximize": (torch.optim.AdamW, {"foreach": False, "maximize": True}),
    "adamw-fused": (torch.optim.AdamW, {"fused": True, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {}),
    "adam-amsgrad-foreach": (torch.optim.Adam, {"amsgrad": True, "foreach": True}),
    "adam-decoupled": (torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    "adam-fused": (torch.optim.Adam, {"fused": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_state_is_torchs_zero_gradient_steps(case):
    cls, kwargs = CASES[case]
    ours_model, theirs_model = _model(), _model()
    ours, theirs = cls(_groups(ours_model), lr=1e-2, **kwargs), cls(_groups(theirs_model), lr=1e-2, **kwargs)
    assert create_empty_state(ours)
    _init_optim_state(theirs)
    _assert_as_torch(ours, theirs, ours_model, theirs_model)
    # and it steps on as torch's does: one real step from each, bitwise
    for model, optimizer in ((ours_model, ours), (theirs_model, theirs)):
        model(torch.ones(2, 6)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _assert_as_torch(ours, theirs, ours_model, theirs_model)


@pytest.mark.parametrize("fused", [False, True])
def test_a_float64_default_dtype_keeps_step_in_float64_unless_fused(fused):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ours_model, theirs_model = _model(), _model()
        ours = torch.optim.AdamW(ours_model.parameters(), fused=fused)
        theirs = torch.optim.AdamW(theirs_model.parameters(), fused=fused)
        assert create_empty_state(ours)
        _init_optim_state(theirs)
        _assert_as_torch(ours, theirs, ours_model, theirs_model)
        assert next(iter(ours.state.values()))["step"].dtype == (torch.float32 if fused else torch.float64)
    finally:
        torch.set_default_dtype(previous)


class _Subclass(torch.optim.AdamW):
    pass


def _not_taken():
    model = _model()
    yield "coupled weight decay", torch.optim.Adam(model.parameters(), weight_decay=0.1)
    yield "a subclass", _Subclass(model.parameters())
    yield "another optimizer", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepped = torch.optim.AdamW(model.parameters())
    _init_optim_state(stepped)
    yield "state already there", stepped
    with_grad = torch.optim.AdamW(_model().parameters())
    with_grad.param_groups[0]["params"][0].grad = torch.zeros(5, 6)
    yield "a gradient set", with_grad
    hooked = torch.optim.AdamW(_model().parameters())
    hooked.register_step_post_hook(lambda *args: None)
    yield "a step hook", hooked
    wrapped = torch.optim.AdamW(_model().parameters())
    wrapped.step = lambda closure=None: None
    yield "an instance's own step", wrapped
    complex_param = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    yield "a complex parameter", torch.optim.AdamW([complex_param])
    yield "differentiable", torch.optim.AdamW(_model().parameters(), differentiable=True)


@pytest.mark.parametrize("index", range(9))
def test_every_other_case_is_left_to_torch(index):
    name, optimizer = list(_not_taken())[index]
    before = {id(p): s.copy() for p, s in optimizer.state.items()}
    assert not create_empty_state(optimizer), name
    assert {id(p): s.copy() for p, s in optimizer.state.items()}.keys() == before.keys(), name


def test_a_global_step_hook_is_left_to_torch():
    optimizer = torch.optim.AdamW(_model().parameters())
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        assert not create_empty_state(optimizer) and not optimizer.state
    finally:
        handle.remove()
    assert create_empty_state(optimizer)


def test_an_lr_schedulers_step_counter_is_no_obstacle():
    optimizer = torch.optim.AdamW(_model().parameters())
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    assert create_empty_state(optimizer)


def _sharded(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    models = []
    for _ in range(2):
        model = _model()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        models.append(model)
    ours = torch.optim.AdamW(_groups(models[0]), lr=1e-2, weight_decay=0.1, amsgrad=True)
    theirs = torch.optim.AdamW(_groups(models[1]), lr=1e-2, weight_decay=0.1, amsgrad=True)
    assert create_empty_state(ours)
    _init_optim_state(theirs)
    _assert_as_torch(ours, theirs, *models)
    assert all(hasattr(s["exp_avg"], "placements") for s in ours.state.values())
    return True


def test_fsdp2_dtensor_parameters_get_dtensor_moments_as_torchs():
    assert run_ranks(2, _sharded) == [True, True]


def _resume_both_ways(rank: int, world: int, folder: str) -> dict:
    """A manager's load into a fresh FSDP2 model and AdamW: with the state made directly, and with
    torch's zero-gradient step (the direct path turned off); every tensor after the load and after
    one more step, and the optimizer steps the loads took."""
    from contextlib import ExitStack
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckpt
    from ckpt import state as ckpt_state

    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int):
        model = _model(seed)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(_groups(model), lr=1e-2, weight_decay=0.1)

    def step(model, optimizer):
        model(torch.full((2, 6), 0.5 + rank)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model, optimizer = build(0)
    step(model, optimizer)
    with ckpt.CheckpointManager(folder, interval=1) as manager:
        manager.save(1, {"model": model, "optim": optimizer})
    results = {}
    for way in ("direct", "torch"):
        model, optimizer = build(7)
        steps, real_step = [], torch.optim.AdamW.step
        with ExitStack() as patches:
            patches.enter_context(mock.patch.object(
                torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(1) or real_step(self, *a, **k)))
            if way == "torch":
                patches.enter_context(mock.patch.object(ckpt_state, "create_empty_state", lambda optimizer: False))
            with ckpt.CheckpointManager(folder, interval=1) as manager:
                assert manager.load({"model": model, "optim": optimizer}) == 1
            loaded_steps = len(steps)
        loaded = copy.deepcopy((optimizer.state_dict(), [p.detach().clone() for p in model.parameters()]))
        step(model, optimizer)
        results[way] = {"steps": loaded_steps, "loaded": loaded,
                        "stepped": (optimizer.state_dict(), [p.detach().clone() for p in model.parameters()])}
    return results


def test_a_managers_resume_is_torchs_without_the_step(tmp_path):
    for rank, result in enumerate(run_ranks(2, _resume_both_ways, str(tmp_path))):
        assert result["direct"]["steps"] == 0 and result["torch"]["steps"] == 1
        for stage in ("loaded", "stepped"):
            assert_same(result["direct"][stage], result["torch"][stage], f"rank {rank} {stage}", tensors_same=_same_bits)
