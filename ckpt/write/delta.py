"""Incremental checkpoints: when a save is a delta, and what it is a delta against.

Policy (``full_every = K``, :class:`DeltaChain`): a full checkpoint, then up to K-1 deltas, each against the previous
snapshot, which is still in the other staging buffer set (no extra copy). A save may be a delta
only when the previous snapshot has the same tensor signature (shapes and dtypes of every local
tensor in order, i.e. the same chunk layout), the chain is shorter than K, and no write since the
last full failed. Every rank must agree (the manager all-reduces the decision), otherwise all write
a full checkpoint.

:class:`DeltaBase` is the base's identity, handed to the writer as one object: its step, its
checkpoint's directory name (a sibling of the new one, recorded in the manifest) and its staged
state, whose chunk at the same global offsets each delta chunk is encoded against.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor

from ..errors import InvalidOptionError
from ..format import is_sibling_name, step_name
from .host_buffers import signature
from ..tree import leaves


def tensor_signature(state_dict: Any) -> tuple:
    """Shapes and dtypes of the (local) tensors of a state tree, in order: two snapshots with equal
    signatures have the same chunk layout (and fit the same staging buffer set)."""
    tensors = (t for t in leaves(state_dict) if isinstance(t, torch.Tensor))
    return signature([t.to_local() if isinstance(t, DTensor) else t for t in tensors])


@dataclass(frozen=True)
class DeltaBase:
    """The checkpoint a delta is written against (see the module docstring)."""

    step: int
    name: str
    state: dict

    def __post_init__(self) -> None:
        if not is_sibling_name(self.name):
            raise InvalidOptionError("base", self.name, "must be a sibling directory name (one path component)")

    @cached_property
    def _flat(self) -> dict:
        return flatten_state_dict(self.state)[0]

    def chunk(self, index: MetadataIndex, dtype: torch.dtype, sizes) -> torch.Tensor | None:
        """The base's chunk at ``index`` when it has the same dtype and sizes, else None."""
        try:
            previous = find_state_dict_object(self._flat, index)
        except (ValueError, KeyError, IndexError, RuntimeError):
            return None
        if not isinstance(previous, torch.Tensor) or previous.dtype != dtype or \
                tuple(previous.shape) != tuple(sizes):
            return None
        return previous


@dataclass(frozen=True)
class _Snapshot:
    step: int
    staged: Future  # of the staged state dict
    signature: tuple


class DeltaChain:
    """The one owner of the save path's delta state: the previous snapshot (the next delta's base),
    the chain's length, whether it is broken, and what each step being written builds on.

    The training thread asks :meth:`eligible` (this rank's view; the manager agrees it across ranks)
    and records each save with :meth:`started`; the writer thread gets the base to encode against
    from :meth:`base_for` (None when the base's write failed after the delta was queued: it is then
    stored whole) and reports the end with :meth:`finished`; retention reads :meth:`bases_in_flight`."""

    def __init__(self, full_every: int):
        self.full_every = full_every
        self._lock = threading.Lock()  # started/eligible on the training thread, the rest on the writer's
        self._previous: _Snapshot | None = None
        self._deltas_in_chain = 0
        self._broken = False
        self._failed: set[int] = set()
        self._writing: dict[int, _Snapshot | None] = {}  # step being written -> its base (None: a full)

    def eligible(self, signature: tuple | None) -> bool:
        """This rank's view: may a snapshot with ``signature`` be stored as a delta?"""
        with self._lock:
            previous = self._previous
            return (self.full_every > 1 and signature is not None and previous is not None and not self._broken
                    and self._deltas_in_chain < self.full_every - 1 and previous.signature == signature)

    def started(self, step: int, staged: Future | None, signature: tuple | None, *, delta: bool) -> None:
        """Record the save just started: a delta on the previous snapshot, or a new full (also a
        synchronous save, which keeps no snapshot)."""
        with self._lock:
            self._writing[step] = self._previous if delta else None
            if not delta:
                self._broken = False  # this save starts a new chain
            self._deltas_in_chain = self._deltas_in_chain + 1 if delta else 0
            self._previous = None if staged is None else _Snapshot(step, staged, signature)

    def base_for(self, step: int) -> DeltaBase | None:
        """The writer thread: the base ``step`` is encoded against (waits for its snapshot), or None."""
        with self._lock:
            base = self._writing.get(step)
            if base is not None and base.step in self._failed:  # queued before its base's write failed
                base = self._writing[step] = None
        return None if base is None else DeltaBase(base.step, step_name(base.step), base.staged.result())

    def finished(self, step: int, failed: bool) -> None:
        """A write ended; after a failure no delta builds on it, so the next save is a full."""
        with self._lock:
            self._writing.pop(step, None)
            if failed:
                self._failed.add(step)
                self._broken = True

    def bases_in_flight(self) -> dict[int, int | None]:
        """Base step of every step being written (None for a full)."""
        with self._lock:
            return {step: None if base is None else base.step for step, base in self._writing.items()}
