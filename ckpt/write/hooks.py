"""SnapshotHooks: the live state held until the last snapshot no longer needs it.

    hooks = SnapshotHooks(wait)               # wait(): block until the snapshot has copied the live tensors
    hooks.attach(optimizer, model=model)      # or attach_everywhere(), for a plug-in
    hooks.snapshot_taken()                    # after each snapshot
    hooks.remove()                            # at close

Before the live state changes, the snapshot copy must be complete: :meth:`SnapshotHooks.attach`
hooks an optimizer's step and the forward of a model's modules with persistent buffers (they change
in forward); :meth:`SnapshotHooks.attach_everywhere` hooks every optimizer's step and, after each
snapshot, the next forward of any module (a plug-in is handed a dict, not the model). Each hook
calls ``wait`` (:meth:`ckpt.write.SavePipeline.before_step`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..optim_state import only_waits
from ..state import buffer_owners


class SnapshotHooks:
    """See the module docstring."""

    def __init__(self, wait: Callable[[], None]):
        self._wait = wait
        self.hooks: list[Any] = []  # what attach registered
        self._everywhere = False  # attach_everywhere: a forward hook is armed after each snapshot
        self._forward_hook = None

    def attach(self, optimizer: torch.optim.Optimizer | None = None, *, model: torch.nn.Module | None = None) -> None:
        """Wait for a pending snapshot before ``optimizer.step()`` and before the forward of every
        module of ``model`` that holds persistent buffers (they change in forward)."""
        if optimizer is not None:
            self.hooks.append(optimizer.register_step_pre_hook(only_waits(lambda *_: self._wait())))
        for module in buffer_owners(model) if model is not None else ():
            self.hooks.append(module.register_forward_pre_hook(lambda *_: self._wait()))

    def attach_everywhere(self) -> None:
        """Wait for a pending snapshot before any optimizer's step and, once after each snapshot, before
        the next forward of any module: for a caller that is handed a dict, not the model."""
        self.hooks.append(register_optimizer_step_pre_hook(only_waits(lambda *_: self._wait())))
        self._everywhere = True

    def snapshot_taken(self) -> None:
        """A snapshot began: with :meth:`attach_everywhere`, the next forward of any module waits for it."""
        if self._everywhere and self._forward_hook is None:
            self._forward_hook = register_module_forward_pre_hook(self._before_forward)

    def remove(self) -> None:
        """Every hook removed (the pipeline is closing)."""
        for hook in [*self.hooks, *([self._forward_hook] if self._forward_hook is not None else [])]:
            hook.remove()
        self.hooks, self._forward_hook, self._everywhere = [], None, False

    def _before_forward(self, *_: Any) -> None:
        self._wait()
        if self._forward_hook is not None:  # the hooks are copied before they run: removing is safe
            self._forward_hook.remove()
            self._forward_hook = None
