"""Turning a user's training state into a DCP state dict and putting loaded values back.

A state is a nested dict whose leaves may be tensors/DTensors, plain values, modules, optimizers or
any object with ``state_dict()``/``load_state_dict()``. Modules and optimizers go through
``torch.distributed.checkpoint.state_dict`` so keys are canonical (no ``_orig_mod.`` from compile,
no FSDP wrapper names) and optimizer state is keyed by parameter name, not by position; that is what
lets a checkpoint load into another parallel layout. An optimizer's hyper-parameters are saved per
parameter too (``optim.param_groups.<fqn>.lr``, torch's ``flatten_optimizer_state_dict``, as
torchtitan saves them): a pipeline stage's groups name only its own parameters, so one
``param_groups`` value per rank would collide under one key and every stage but one would load
another stage's groups. Checkpoints that stored ``param_groups`` whole still load (the layout is
read from the manifest's keys).

A caller that saves the same objects again and again (the manager, every step with the memory tier)
passes a :class:`~ckpt.state_names.StateNames`: torch's names for the model's and optimizers' values
are then worked out once, not at each save; every value is still read fresh (see that module).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .tree import DESCEND, descend_containers, leaves, transform
from .format.values import Leaf
from .optim_state import create_empty_state
from .state_names import FLAT, StateNames


def export_state(state: dict, whole: Callable[[tuple], bool] | None = None, *,
                 names: StateNames | None = None) -> tuple[dict, Callable[[], None]]:
    """Return ``(state_dict, restore)``: a DCP-ready tree, and a function that pushes values loaded
    into that tree back into the user's objects (modules, optimizers, stateful objects, dicts).

    Tensor-free subtrees become single :class:`~ckpt.format.values.Leaf` values where ``whole(path)`` says
    so (always, when saving; when loading, wherever the checkpoint stored them whole — one saved
    by plain DCP has them flattened instead). ``names``: the names kept from earlier saves of these
    objects (saving only; the same tree as without)."""
    modules = [v for v in leaves(state, into=(dict, list)) if isinstance(v, nn.Module)]
    if names is not None and whole is None:
        names.new_export()
    else:
        names = None
    exporter = _Exporter(modules, whole or (lambda path: True), loading=whole is not None, names=names)
    tree = {key: exporter.export(value, (key,)) for key, value in state.items()}

    def restore() -> None:
        for fn in exporter.restorers:
            fn()
        _write_back(state, tree)

    return tree, restore


def stored_whole(value_keys: set[str], all_keys) -> Callable[[tuple], bool]:
    """The ``whole`` predicate for loading a checkpoint with these value keys and all keys."""
    inner = {key[:i] for key in all_keys for i, ch in enumerate(key) if ch == "."}

    def whole(path: tuple) -> bool:
        key = ".".join(map(str, path))
        return key in value_keys or key not in inner

    whole.keys = frozenset(all_keys)  # what the checkpoint stores: the optimizers' group layout is read from it
    return whole


class _Exporter:
    def __init__(self, modules: list[nn.Module], whole: Callable[[tuple], bool], *, loading: bool = False,
                 names: StateNames | None = None):
        self.modules, self.whole, self.loading, self.names = modules, whole, loading, names
        self.restorers: list[Callable[[], None]] = []

    def export(self, node: Any, path: tuple) -> Any:
        """Live objects become their state dicts (restorers noted); tensor- and object-free
        dicts/lists become one :class:`~ckpt.format.values.Leaf` where ``whole`` says so."""
        return transform(node, self._export_visit, path)

    def _export_visit(self, node: Any, path: tuple) -> Any:
        if isinstance(node, (dict, list)):
            return Leaf(node) if not _holds_live_object(node) and self.whole(path) else DESCEND
        if isinstance(node, nn.Module):
            model_state = get_model_state_dict(node) if self.names is None else self.names.model_state_dict(node)
            sd = self.collapse_within(model_state, path)
            self.restorers.append(lambda: set_model_state_dict(node, _unwrap(sd)))
            return sd
        if isinstance(node, torch.optim.Optimizer):
            owner = _owner_module(node, self.modules, None if self.names is None else self.names.parameters)
            if owner is None:  # no model beside it: positional keys, same layout required
                sd = self.collapse_within(node.state_dict(), path)
                self.restorers.append(lambda: node.load_state_dict(_unwrap(sd)))
                return sd
            # groups per parameter, unless loading a checkpoint that stored them by position (older saves)
            create_empty_state(node)  # what torch's state-dict API would make by a zero-gradient step, without it
            flat = not (self.loading and _groups_by_position(getattr(self.whole, "keys", ()), path))
            options = FLAT if flat else StateDictOptions(flatten_optimizer_state_dict=False)
            optimizer_state = (get_optimizer_state_dict(owner, node, options=options) if self.names is None
                               else self.names.optimizer_state_dict(owner, node))
            sd = self.collapse_within(optimizer_state, path)
            self.restorers.append(lambda: set_optimizer_state_dict(owner, node, _unwrap(sd), options=options))
            return sd
        if _is_stateful(node):
            sd = self.collapse_within(node.state_dict(), path)
            self.restorers.append(lambda: node.load_state_dict(_unwrap(sd)))
            return sd
        return node

    def collapse_within(self, state_dict: dict, path: tuple) -> dict:
        """Collapse below the top level, so the dict a restorer holds is the one DCP fills in place."""
        return {key: value if isinstance(value, _UNCHANGED) else self._collapse(value, path + (key,))
                for key, value in state_dict.items()}  # most values (tensors, hyper-parameters) stay as they are

    def _collapse(self, value: Any, path: tuple) -> Any:
        if type(value) is tuple and all(isinstance(item, _SCALARS) for item in value):  # an optimizer's betas
            return Leaf(value) if self.whole(path) else value
        return transform(value, self._collapse_visit, path)

    def _collapse_visit(self, node: Any, path: tuple) -> Any:
        """Wrap tensor-free dict/list/tuple subtrees into one :class:`~ckpt.format.values.Leaf` each."""
        if isinstance(node, (dict, list, tuple)):
            if not _holds_tensor(node) and self.whole(path):
                return Leaf(node)
            return DESCEND if isinstance(node, (dict, list)) else node
        return node


_SCALARS = (int, float, str, type(None))
_UNCHANGED = (torch.Tensor, *_SCALARS)  # values collapsing leaves as they are

_POSITIONAL_GROUP = re.compile(r"\d+\.(params|lr)(\.|$)")


def _groups_by_position(keys, path: tuple) -> bool:
    """Whether a checkpoint holding ``keys`` stored the optimizer at ``path``'s ``param_groups`` by
    position — whole (one value: our saves before the per-parameter layout) or as DCP flattens a
    list (``optim.param_groups.0.lr``, ``....0.params.3``: a plain DCP checkpoint imported) — rather
    than per parameter (``optim.param_groups.<fqn>.lr``)."""
    prefix = ".".join(map(str, path)) + ".param_groups"
    if prefix in keys:
        return True
    start = len(prefix) + 1
    return any(key.startswith(prefix + ".") and _POSITIONAL_GROUP.match(key, start) for key in keys)


def _unwrap(node: Any) -> Any:
    """Undo collapsing where a leaf was not replaced by a loaded value."""
    return transform(node, descend_containers(lambda leaf: leaf.value if isinstance(leaf, Leaf) else leaf))


def _holds_tensor(node: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in leaves(node))


def _is_stateful(node: Any) -> bool:
    return callable(getattr(node, "state_dict", None)) and callable(getattr(node, "load_state_dict", None))


def _owner_module(optimizer: torch.optim.Optimizer, modules: list[nn.Module],
                  parameters: Callable[[nn.Module], Any] | None = None) -> nn.Module | None:
    """The first of ``modules`` holding every parameter of ``optimizer`` (``parameters(module)``:
    its parameters, when the caller has them already)."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if wanted <= {id(p) for p in (module.parameters() if parameters is None else parameters(module))}:
            return module
    return None


def _write_back(user: dict, tree: dict) -> None:
    """Put loaded non-tensor values into the user's state in place (see :func:`_load_into`)."""
    for key, value in tree.items():
        user[key] = _load_into(user[key], value) if key in user else value


def _load_into(current: Any, loaded: Any) -> Any:
    """What takes ``current``'s place after a load. A dict or list the user holds is updated in
    place, so references kept elsewhere (a loader's position dict) see the loaded values; live
    objects were loaded already (tensors in place, modules and stateful objects by their
    restorers); a value the checkpoint did not hold (a non-strict load) stays; the rest is replaced."""
    if isinstance(loaded, Leaf) or _is_live_object(current):
        return current
    if isinstance(current, dict) and isinstance(loaded, dict):
        for key in [k for k in current if k not in loaded and not _holds_live_object(current[k])]:
            del current[key]
        for key, value in loaded.items():
            current[key] = _load_into(current[key], value) if key in current else value
        return current
    if isinstance(current, list) and isinstance(loaded, list):
        current[:] = [_load_into(c, v) for c, v in zip(current, loaded)] + loaded[len(current):]
        return current
    return loaded


def _holds_live_object(node: Any) -> bool:
    return any(_is_live_object(leaf) for leaf in leaves(node, into=(dict, list)))


def _is_live_object(node: Any) -> bool:
    """Tensors are loaded in place; modules, optimizers and stateful objects via their restorers."""
    return isinstance(node, torch.Tensor) or isinstance(node, nn.Module) or _is_stateful(node)


class RNGState:
    """The process's random generators as a stateful object: torch CPU (and the accelerator's, when
    present), Python's ``random`` and NumPy's global generator. Put it in a state to checkpoint them."""

    def state_dict(self) -> dict:
        state = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        from .device import accelerator_module

        accel = accelerator_module()
        if accel is not None:
            state["accelerator"] = accel.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(_as_tuple(state["python"]))
        np.random.set_state(state["numpy"])
        if "accelerator" in state:
            from .device import accelerator_module

            accel = accelerator_module()
            if accel is not None:
                accel.set_rng_state(state["accelerator"])


def _as_tuple(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def buffer_owners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose forward may change checkpointed buffers: each owner of a persistent buffer,
    and the root when it is a DDP module that broadcasts buffers before its forward."""
    owners = [m for m in model.modules()
              if any(name not in m._non_persistent_buffers_set for name, b in m._buffers.items() if b is not None)]
    if owners and getattr(model, "broadcast_buffers", False) and model not in owners:
        owners.insert(0, model)
    return owners
