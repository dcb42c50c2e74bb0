"""An Adam/AdamW optimizer's empty state created directly: what torch's state-dict API would make
by running a whole optimizer step, without the step.

``get_optimizer_state_dict`` needs an optimizer's state to exist; for one that has not stepped yet
(every resume: the optimizer is new) torch's ``_init_optim_state`` gives every trainable parameter
a zero gradient, sets the learning rate to 0 and calls ``step()`` — a full pass of the optimizer's
arithmetic over the model (on a sharded model, every DTensor op dispatched), only for the loaded
values to overwrite its result. For ``torch.optim.Adam`` and ``AdamW`` that result is known exactly:

    state[p] = {"step": tensor(1.0), "exp_avg": zeros_like(p), "exp_avg_sq": zeros_like(p)
                [, "max_exp_avg_sq": zeros_like(p)  with amsgrad]}

for each parameter that requires grad, in parameter order; ``step`` a 0-dim float32 tensor (float64
under a float64 default dtype) on the CPU, or on the parameter's device (float32) when fused or
capturable; the parameters untouched (a zero learning rate), gradients left None. :func:`create_empty_state`
builds that and returns True; anything else — another optimizer class (a subclass too), a state
already there, a gradient already set, Adam's coupled weight decay (the zero step would fold the
weights into the moments), complex or differentiable groups, step hooks that the step would have
run (but ckpt's own, which only wait for a snapshot: :func:`only_waits`) — is left to torch's own
initialisation (False). Equality with torch's result, tensor by tensor
and bit for bit, is tested for each case taken (tests/ckpt/test_optim_state.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.optim import Adam, AdamW
from torch.optim import optimizer as torch_optimizer

_TAKEN = (Adam, AdamW)


def create_empty_state(optimizer: torch.optim.Optimizer) -> bool:
    """Give ``optimizer`` the state torch's zero-gradient step would (see the module docstring);
    whether it did (False: not a case taken, nothing changed)."""
    if not _taken(optimizer):
        return False
    for group in optimizer.param_groups:
        on_device = group["fused"] or group["capturable"]
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = optimizer.state[p]
            state["step"] = _step_one(p, fused=group["fused"], on_device=on_device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True


def only_waits(hook: Callable) -> Callable:
    """Mark a step hook of ckpt's that only waits (it changes no tensor; the state made here is new):
    one the empty state need not run."""
    hook._ckpt_only_waits = True
    return hook


def _taken(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) not in _TAKEN or optimizer.state:
        return False
    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
    if any(not getattr(hook, "_ckpt_only_waits", False) for registered in hooks for hook in registered.values()):
        return False
    step = vars(optimizer).get("step")  # an instance's own step: only an LR scheduler's step counter
    if step is not None and not getattr(step, "_wrapped_by_lr_sched", False):
        return False
    for group in optimizer.param_groups:
        if group.get("differentiable") or (group.get("weight_decay") and not _decoupled(optimizer, group)):
            return False
        for p in group["params"]:
            if p.grad is not None or torch.is_complex(p):
                return False
    return True


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return type(optimizer) is AdamW or bool(group.get("decoupled_weight_decay"))


def _step_one(p: torch.Tensor, *, fused: bool, on_device: bool) -> torch.Tensor:
    """The ``step`` a first step leaves: 1, where and in the dtype torch's Adam keeps it."""
    if on_device:
        return torch.ones((), dtype=torch.float32 if fused else _scalar_dtype(), device=p.device)
    return torch.tensor(1.0, dtype=_scalar_dtype(), device="cpu")


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
