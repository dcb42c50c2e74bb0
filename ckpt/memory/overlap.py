"""Pieces of a stream handled one piece behind, on a thread of its own, while the caller fills the
next one: a partner copy's sender sends a piece while it reads the next; its receiver checks and
writes a piece while it receives the next (:mod:`ckpt.memory.partner`). Two buffers per end.

    with Behind(piece_bytes, name="ckpt-partner-send") as behind:
        for ...:
            buffer = behind.buffer()           # the one not in the worker's hands
            ... fill buffer[:n] ...
            behind.hand(n, work)               # work(buffer[:n]) on the thread, in order
    # leaving waits for the last piece; a work's exception is raised by the next hand() or wait()
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


class Behind:
    """``work(piece)`` (a uint8 CPU tensor) for each piece handed over, in order, one at a time on a
    thread of its own (see the module docstring)."""

    def __init__(self, piece_bytes: int, *, name: str):
        self.buffers = [torch.empty(max(1, piece_bytes), dtype=torch.uint8) for _ in range(2)]
        self.turn = 0
        self.pending: Future | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def buffer(self) -> torch.Tensor:
        """The buffer to fill next (the worker holds the other one)."""
        return self.buffers[self.turn]

    def hand(self, n: int, work: Callable[[torch.Tensor], None]) -> None:
        """``work(buffer()[:n])`` on the thread, once the previous piece's work is done (its
        exception raised here)."""
        self.wait()
        self.pending = self.pool.submit(work, self.buffers[self.turn][:n])
        self.turn ^= 1

    def wait(self) -> None:
        """The work handed over so far done (an exception of it raised)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def settle(self) -> None:
        """The work handed over so far done, its exception dropped (the caller is raising one of its own)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.exception()

    def __enter__(self) -> "Behind":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.wait()
            else:
                self.settle()
        finally:
            self.pool.shutdown(wait=True)
