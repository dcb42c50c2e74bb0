"""torchtitan 0.3.0's llama3 in the tests' process, on CPU, and checkpoints in the layout its
``CheckpointManager`` writes and reads.

:func:`llama3` imports ``torchtitan.models.llama3`` (the test is skipped when torchtitan is not
installed). torchtitan's model package imports its MoE expert-parallel kernels, which import
triton; where triton is missing (CPU machines) that one package,
``torchtitan.distributed.minimal_async_ep`` (not used by llama3), is stood in for by an empty
module — everything else is torchtitan's own.

:func:`titan_state` is the state torchtitan's DCP checkpointer saves and loads
(``components/checkpointer/dcp.py``): its ``ModelWrapper``'s flat model state at the top, the flat
optimizer state of its own ``get_flat_optim_state_dict`` / ``load_flat_optim_state_dict`` under
``optimizer``, ``lr_scheduler.last_epoch``, ``train_state`` and (when saving) the data loader's
per-dp-rank pickle. :func:`titan_run` builds its ``debugmodel`` with its model classes and AdamW
over ``(name, param)`` pairs (as its optimizer container does), takes ``steps`` optimizer steps with
seeded gradients under torchtitan's LR lambda and saves ``folder/step-N`` with plain DCP.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

_NEEDS_TRITON = "torchtitan.distributed.minimal_async_ep"


def llama3():
    """``torchtitan.models.llama3`` (skips without torchtitan; see the module docstring)."""
    pytest.importorskip("torchtitan")
    try:
        import triton  # noqa: F401
    except ImportError:
        for name in (_NEEDS_TRITON, f"{_NEEDS_TRITON}.api", f"{_NEEDS_TRITON}.kernels"):
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__path__ = []
            module.__getattr__ = _placeholder
            sys.modules.setdefault(name, module)
    return importlib.import_module("torchtitan.models.llama3")


def _placeholder(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})


def build(flavor: str = "debugmodel", seed: int = 0) -> torch.nn.Module:
    """torchtitan's llama3 ``flavor`` on the CPU, initialised by its own ``init_states``."""
    spec = llama3().model_registry(flavor)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def adamw(model: torch.nn.Module, lr: float = 8e-4) -> torch.optim.Optimizer:
    """AdamW over ``(name, param)`` pairs, as torchtitan's ``OptimizersContainer`` builds it."""
    return torch.optim.AdamW(list(model.named_parameters()), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


class _Optimizer(Stateful):
    """The optimizer as torchtitan's ``OptimizersContainer`` checkpoints it (flat, parameter-keyed)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_dict(self):
        from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state

        init_optim_state(self.optimizer)
        return get_flat_optim_state_dict(self.optimizer)

    def load_state_dict(self, state):
        from torchtitan.components.optimizer.utils import init_optim_state, load_flat_optim_state_dict

        init_optim_state(self.optimizer)
        load_flat_optim_state_dict(self.optimizer, state)


class _Scheduler(Stateful):
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self):
        return {"last_epoch": self.scheduler.last_epoch}

    def load_state_dict(self, state):
        self.scheduler.last_epoch = state["last_epoch"]


class TrainState(Stateful):
    def __init__(self, step: int = 0, ntokens_seen: int = 0):
        self.step, self.ntokens_seen = step, ntokens_seen

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def titan_state(model, optimizer, scheduler, train: TrainState, *, with_dataloader: bool) -> tuple[dict, object]:
    """(the state torchtitan's checkpointer hands to DCP, its ``ModelWrapper``)."""
    from torchtitan.components.checkpointer.base import ModelWrapper

    wrapper = ModelWrapper(model)
    state = {**wrapper.state_dict(), "optimizer": _Optimizer(optimizer), "lr_scheduler": _Scheduler(scheduler),
             "train_state": train}
    if with_dataloader:
        state["dataloader"] = {"dp_rank_0": pickle.dumps({"sample_idx": 7}), "world_size": 1}
    return state, wrapper


def lr_lambda(step: int) -> float:
    """A linear warmup over 2 steps then a linear decay to 0 at step 10 (the shape of torchtitan's
    debugmodel schedule; the function itself is local to torchtitan's config)."""
    return (step + 1) / 2 if step < 2 else max(0.0, 1 - (step + 1 - 2) / 8)


def titan_run(folder: Path, steps: int = 2, seed: int = 0):
    """torchtitan's debugmodel after ``steps`` optimizer steps, saved at ``folder/step-<steps>``;
    returns (model, optimizer, scheduler, train state)."""
    model = build(seed=seed)
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator) * 1e-2
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    train = TrainState(steps, steps * 8 * 64)
    state, _ = titan_state(model, optimizer, scheduler, train, with_dataloader=True)
    dcp.save(state, checkpoint_id=str(folder / f"step-{steps}"), no_dist=True)
    return model, optimizer, scheduler, train


def titan_load(path: Path, flavor: str = "debugmodel"):
    """A fresh torchtitan debugmodel, optimizer, scheduler and train state loaded from ``path`` as
    its checkpointer loads (``exclude_from_loading = ["dataloader"]``)."""
    model = build(flavor, seed=123)
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    train = TrainState()
    state, wrapper = titan_state(model, optimizer, scheduler, train, with_dataloader=False)
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    wrapper.load_state_dict(state)
    return model, optimizer, scheduler, train
