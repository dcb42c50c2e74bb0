"""The cyclic garbage collector paused while a load builds large acyclic structures.

A manifest of 8,192 ranks parses into hundreds of thousands of dicts, lists, tuples and
dataclasses; each of Python's full collections walks every one of them, and they come more often as
the heap grows, so parsing and planning cost more than linear in the world size with the collector
on (1.6× the collector-off time at 8,192 ranks, 1.05× at 1,024: benchmarks/bench_planning.py).
Nothing built there holds a cycle, so nothing is lost by collecting after. :func:`paused_gc` nests
and is thread-safe: the collector comes back, if it was on, when the last pause ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
