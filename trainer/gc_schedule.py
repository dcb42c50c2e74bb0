"""Garbage collection on a schedule: the interpreter's automatic collection off during training (its
pauses land on random steps, on every rank at other times), generations 0-1 collected every
``training.gc_freq`` steps instead, as torchtitan does."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def scheduled_garbage_collection(gc_freq: int):
    """Automatic collection off for the block; ``collect(step)`` runs generations 0-1 every
    ``gc_freq`` steps. Restores the interpreter's previous setting on exit."""
    if gc_freq <= 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect(1)
    try:
        yield lambda step: gc.collect(1) if step % gc_freq == 0 else None
    finally:
        if was_enabled:
            gc.enable()
