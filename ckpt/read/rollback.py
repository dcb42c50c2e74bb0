"""A failed load puts the live tensors back: an undo copy of each region a load is about to write.

A load writes into the caller's tensors as it goes (straight into them where the layouts allow:
``ckpt/read/prefetch.py``, ``ckpt/read/scatter.py``, ``ckpt/read/exchange.py``), and whether it succeeds is
known only at its end, on every rank together (a damaged block one rank finds, a peer that dies,
fails the load on all of them). So before the first byte of a region lands, the planner's
``resolve_tensor`` — the one place every read path gets its target from — hands the region here,
and a copy of its bytes is kept on the host; a failed load copies every kept region back (newest
first, so the oldest copy of a region written twice wins), a successful one drops them.

The price is memory: up to the bytes this rank loads, on the host, until the load returns (a
device tensor's copy goes to host memory, not the device's). A staged copy of the whole load
read before a single live byte changes would cost the same, and reading every byte twice (once to
verify, once to load) would cost the time of a second load; a partial undo cannot give the promise
(a damaged last block would leave every earlier tensor loaded). ``ckpt.load(..., rollback=False)``
skips the copies for a caller that loads something else in full after a failure anyway.
"""

from __future__ import annotations

import threading

import torch


class Rollback:
    """Undo copies of the live regions one load writes (see the module docstring)."""

    def __init__(self):
        self._kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def keep(self, key: tuple, region: torch.Tensor) -> None:
        """Copy ``region`` (a view of a live tensor) once, before the load first writes it."""
        with self._lock:
            if key in self._kept:
                return
            copy = region.detach().to("cpu", copy=True)
            self._kept[key] = (region, copy)

    def restore(self) -> None:
        """Write every kept copy back into its region, the newest first; then forget them."""
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        with torch.no_grad():
            for region, copy in reversed(kept):
                region.copy_(copy)

    def forget(self) -> None:
        with self._lock:
            self._kept = {}
