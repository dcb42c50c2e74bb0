"""StateNames: torch's names for a model's and its optimizers' state, worked out once and used by
every later save of the same objects.

``torch.distributed.checkpoint.state_dict``'s ``get_model_state_dict`` and ``get_optimizer_state_dict``
name each value by its parameter's fully qualified name (no ``module.`` of DDP, no ``_orig_mod.`` of
compile, no activation-checkpoint wrapper) and flatten an optimizer's state and hyper-parameters per
parameter. Working the names out walks every module and parameter (``_verify_options``, ``_get_fqns``
for each key) at each call: most of what a save costs the training thread for a model saved every
step (issue 38). Only the *names* are kept here. Every value is read again at each save from the
model's and the optimizer's own ``state_dict()`` (their hooks run), so a learning rate a scheduler has
just set, a tensor a load put in place and an optimizer state made or replaced since are what is saved.

A naming is used only while all it depends on is unchanged: the same model (optimizer) object; the
same module objects, in order; the same ``named_parameters()`` (names and parameter objects); the
same parameter objects in the optimizer's groups, group by group; the same keys of the model's
``state_dict()``; no ``state_dict`` patched onto the object. Anything else (a module or parameter
replaced, a param group added, a buffer registered) works the names out again through torch. A new
naming must first give, for the save at hand, exactly torch's result (the same keys in the same
order; an optimizer's values the same objects); where it does not, or where torch takes another
path (FSDP1 modules and their state-dict contexts; an optimizer with no state yet, which torch
initialises by a step), torch's functions serve every save of those objects, as before.

Assumed, as torch assumes within one call: a module's ``_fqn_modifiers`` answers the same while it is
the same object.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:  # how torch names one key (what its functions apply to every key); without it nothing is kept
    from torch.distributed.checkpoint.state_dict import _get_fqns
except ImportError:  # pragma: no cover - another torch
    _get_fqns = None

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class _Walk:
    """What a naming depends on in a module tree, read once per export."""

    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]
    params: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, model: nn.Module) -> _Walk:
        named = tuple(model.named_parameters())
        return cls(tuple(model.modules()), tuple(n for n, _ in named), tuple(p for _, p in named))

    def same(self, other: _Walk) -> bool:
        return (_same(self.modules, other.modules) and self.names == other.names
                and _same(self.params, other.params))


@dataclass(frozen=True)
class _ModelNaming:
    model: nn.Module
    walk: _Walk
    keys: tuple[str, ...] | None  # the model's state_dict() keys; None: torch at every save
    renamed: dict[str, str]  # key -> torch's name, where they differ


@dataclass(frozen=True)
class _OptimizerNaming:
    optimizer: torch.optim.Optimizer
    owner: nn.Module
    walk: _Walk
    groups: tuple[tuple[torch.Tensor, ...], ...]  # the parameters of each group
    names: dict[int, str] | None  # position in the groups -> parameter name; None: torch at every save


class StateNames:
    """Model and optimizer state dicts as torch's functions give them (see the module docstring), for
    one caller's repeated saves (a :class:`~ckpt.manager.CheckpointManager` holds one, through
    :func:`ckpt.state.export_state`). :meth:`new_export` starts each export: until the next, a module
    tree is read once and taken as unchanged. Not thread-safe."""

    def __init__(self) -> None:
        self._models: dict[int, _ModelNaming] = {}
        self._optimizers: dict[int, _OptimizerNaming] = {}
        self._walks: dict[int, tuple[nn.Module, _Walk]] = {}
        self._used: set[int] = set()

    def new_export(self) -> None:
        """Start one export of a state: the module trees are read again; namings of objects the last
        export did not use are let go."""
        self._models = {k: v for k, v in self._models.items() if k in self._used}
        self._optimizers = {k: v for k, v in self._optimizers.items() if k in self._used}
        self._walks, self._used = {}, set()

    def model_state_dict(self, model: nn.Module) -> dict:
        """``get_model_state_dict(model)``."""
        self._used.add(id(model))
        walk = self._walk(model)
        naming = self._models.get(id(model))
        if naming is not None and naming.model is model and naming.walk.same(walk) and "state_dict" not in vars(model):
            if naming.keys is None:
                return get_model_state_dict(model)
            state_dict = model.state_dict()
            if state_dict and tuple(state_dict) == naming.keys:
                return _renamed(state_dict, naming.renamed)
        result = get_model_state_dict(model)
        self._models[id(model)] = _model_naming(model, walk, result)
        return result

    def optimizer_state_dict(self, owner: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """``get_optimizer_state_dict(owner, optimizer, options=FLAT)``."""
        self._used.add(id(optimizer))
        walk = self._walk(owner)
        groups = tuple(tuple(group["params"]) for group in optimizer.param_groups)
        naming = self._optimizers.get(id(optimizer))
        if (naming is not None and naming.optimizer is optimizer and naming.owner is owner and naming.walk.same(walk)
                and len(groups) == len(naming.groups) and all(map(_same, groups, naming.groups))
                and optimizer.state and "state_dict" not in vars(optimizer)):
            if naming.names is None:
                return get_optimizer_state_dict(owner, optimizer, options=FLAT)
            flat = _flatten(optimizer.state_dict(), naming.names)
            if flat:
                return flat
        initialised = bool(optimizer.state)  # else torch initialises it by a step: name it at the next save
        result = get_optimizer_state_dict(owner, optimizer, options=FLAT)
        if initialised:
            self._optimizers[id(optimizer)] = _optimizer_naming(owner, optimizer, walk, groups, result)
        return result

    def parameters(self, model: nn.Module) -> tuple[torch.Tensor, ...]:
        """``tuple(model.parameters())``, read once per export."""
        return self._walk(model).params

    def _walk(self, model: nn.Module) -> _Walk:
        seen = self._walks.get(id(model))
        if seen is None or seen[0] is not model:
            seen = self._walks[id(model)] = (model, _Walk.of(model))
        return seen[1]


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _one_name(model: nn.Module, key: str) -> str | None:
    names = _get_fqns(model, key)
    return next(iter(names)) if len(names) == 1 else None


def _model_naming(model: nn.Module, walk: _Walk, result: dict) -> _ModelNaming:
    """How ``result`` (torch's, for this save) names the model's ``state_dict()`` keys, if that can be kept."""
    unkept = _ModelNaming(model, walk, None, {})
    if _get_fqns is None or "state_dict" in vars(model) or FSDP.fsdp_modules(model):
        return unkept
    keys = tuple(model.state_dict())
    names = [_one_name(model, key) for key in keys]
    if None in names:
        return unkept
    renamed = {key: name for key, name in zip(keys, names) if name != key}
    if list(_renamed(dict.fromkeys(keys), renamed)) != list(result):
        return unkept
    return _ModelNaming(model, walk, keys, renamed)


def _renamed(state_dict: dict, renamed: dict[str, str]) -> dict:
    """``state_dict`` with its keys renamed as torch renames them (in place: a renamed key moves to the end)."""
    for key in [k for k in state_dict if k in renamed] if renamed else ():
        state_dict[renamed[key]] = state_dict.pop(key)
    return state_dict


def _optimizer_naming(owner: nn.Module, optimizer: torch.optim.Optimizer, walk: _Walk,
                      groups: tuple, result: dict) -> _OptimizerNaming:
    """Parameter names by position in the groups, as torch gave them in ``result``, if that can be kept."""
    unkept = _OptimizerNaming(optimizer, owner, walk, groups, None)
    if _get_fqns is None or "state_dict" in vars(optimizer) or FSDP.fsdp_modules(owner):
        return unkept
    position = {param: i for i, param in enumerate(p for group in groups for p in group)}
    names: dict[int, str] = {}
    for key, param in zip(walk.names, walk.params):
        name = _one_name(owner, key)
        if name is None:
            return unkept
        if param in position:
            names[position[param]] = name
    mine = _flatten(optimizer.state_dict(), names)
    if mine is None or list(mine) != list(result) or any(mine[k] is not v for k, v in result.items()):
        return unkept
    return _OptimizerNaming(optimizer, owner, walk, groups, names)


def _flatten(state_dict: dict, names: dict[int, str]) -> dict | None:
    """An optimizer's ``state_dict()`` with parameter names for positions, flattened as torch flattens
    it (``state.<name>.<key>...``, then ``param_groups.<name>.<hyper-parameter>``, group by group); None
    where torch would refuse it (a position without a name, a state value of another type)."""
    flat: dict[str, Any] = {}
    try:
        for position, state in state_dict["state"].items():
            if not _flatten_nested(state, f"state.{names[position]}", flat):
                return None
        for group in state_dict["param_groups"]:
            hyper = [(key, value) for key, value in group.items() if key != "params"]
            for position in group["params"]:
                name = names[position]
                for key, value in hyper:
                    flat[f"param_groups.{name}.{key}"] = value
    except (KeyError, TypeError, AttributeError):
        return None
    return flat


def _flatten_nested(state: dict, prefix: str, flat: dict) -> bool:
    for key, value in state.items():
        name = f"{prefix}.{str(key)}"
        if isinstance(value, dict):
            if not _flatten_nested(value, name, flat):
                return False
        elif isinstance(value, (torch.Tensor, int, float)):
            flat[name] = value
        else:
            return False
    return True
