"""torch's ``MemTracker`` made fit for one whole training step of a parallel layout under FakeTensorMode.

Contract: :class:`StepTracker` is ``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch
mode that counts every tensor storage alive, by category, and keeps the peak) with three changes,
each for a case the stock tracker gets wrong or cannot run:

* a root module called again in the same step (gradient accumulation's micro-steps, a pipeline
  stage's microbatches) is taken as another call, not refused as "multiple iterative calls";
* only the global peak is kept (the stock tracker also updates every active module's own peak on
  every operation: quadratic in the layers, ten minutes for a 70B step instead of one);
* tensors made by DTensor's sharding propagation are not counted: under an outer FakeTensorMode,
  DTensor builds its fake arguments at their *global* shapes in that same mode, so the stock
  tracker counts, e.g. for a foreach norm over the gradients, every parameter unsharded
  (:func:`untracked_propagation` pauses the tracker around it, through the propagator's lock hook).

:func:`peak` reads the peak (bytes) and its breakdown by category.
"""

from __future__ import annotations

import contextlib

import torch.distributed._tools.fake_collectives  # noqa: F401  (fake kernels of the c10d collectives)
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker


class StepTracker(MemTracker):
    """See the module docstring."""

    paused = False

    def _track(self, reftype, t) -> None:
        if not self.paused:
            super()._track(reftype, t)

    def _update_peak_stats(self, peak_state) -> None:
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[device] = snap[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snap)

    def _pre_fw_hook(self, module, inputs) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if (module in self.memory_tracking and not self._mod_tracker.is_bw
                and set(self._mod_tracker.parents) - {name} == {"Global"}):
            del self.memory_tracking[module]  # the root again: the next micro-step, not the next step
        super()._pre_fw_hook(module, inputs)


@contextlib.contextmanager
def untracked_propagation(tracker: StepTracker):
    """While active, DTensor's sharding propagation runs with ``tracker`` paused."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class _Pause:
        def __enter__(self):
            tracker.paused = True

        def __exit__(self, *exc):
            tracker.paused = False

    before = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = _Pause()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = before


def peak(tracker: StepTracker) -> tuple[int, dict[str, int]]:
    """(peak bytes over all devices, {category: bytes} at that peak)."""
    snaps = tracker.get_tracker_snapshot("peak")
    total, breakdown = 0, {}
    for snap in snaps.values():
        total += snap.get(_TOTAL_KEY, 0)
        for key, value in snap.items():
            if key != _TOTAL_KEY:
                name = getattr(key, "value", str(key))
                breakdown[name] = breakdown.get(name, 0) + value
    return total, breakdown
