"""Incremental checkpoints: when a save is a delta, and what it is a delta against.

Policy (``full_every = K``, :class:`DeltaChain`): a full checkpoint, then up to K-1 deltas, each against the previous
snapshot, which is still in the other staging buffer set (no extra copy). A save may be a delta
only when the previous snapshot has the same tensor signature (shapes and dtypes of every local
tensor in order, i.e. the same chunk layout), went to a sibling destination at another step
(:func:`may_build_on`), the chain is shorter than K, and no write since the last full failed. Every
rank must agree (:mod:`ckpt.write.pipeline` all-reduces the decision), otherwise all write a full
checkpoint.

:class:`DeltaBase` is the base's identity, handed to the writer as one object: its step, its
checkpoint's directory name (a sibling of the new one, recorded in the manifest) and its staged
state, whose chunk at the same global offsets each delta chunk is encoded against.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Hashable

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor

from ..errors import InvalidOptionError
from ..format import is_sibling_name
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


def may_build_on(target: Any, base: Any) -> bool:
    """Whether a save to ``target`` may be a delta of the save to ``base`` (each a destination with
    ``key``, ``step``, ``folder`` and ``name``, as :class:`ckpt.write.pipeline.Target`): siblings in one
    folder, another destination at another step, and ``base`` has a name a manifest can record."""
    return (base.name is not None and base.key != target.key and base.folder == target.folder
            and base.step is not None and target.step is not None and base.step != target.step)


@dataclass(frozen=True)
class _Snapshot:
    target: Any  # where it was saved: key, step, folder, name
    staged: Future  # of the staged state dict
    signature: tuple


class DeltaChain:
    """The one owner of the save path's delta state: the previous snapshot (the next delta's base),
    the chain's length, whether it is broken, and what each save being written builds on.

    Saves are told by their destination (a :class:`ckpt.write.pipeline.Target`; its ``key`` names it:
    the manager's step, a plug-in's path). The training thread asks :meth:`eligible` (this rank's view;
    the pipeline agrees it across ranks) and records each save with :meth:`started` (or :meth:`copied`);
    the writer thread gets the base to encode against from :meth:`base_for` (None when the base's write
    failed after the delta was queued: it is then stored whole) and reports the end with
    :meth:`finished`; retention reads :meth:`bases_in_flight`."""

    def __init__(self, full_every: int):
        self.full_every = full_every
        self._lock = threading.Lock()  # started/eligible on the training thread, the rest on the writer's
        self._previous: _Snapshot | None = None
        self._deltas_in_chain = 0
        self._broken = False
        self._failed: set[Hashable] = set()
        self._writing: dict[Hashable, _Snapshot | None] = {}  # key being written -> its base (None: whole)

    def eligible(self, target: Any, signature: tuple | None) -> bool:
        """This rank's view: may a snapshot with ``signature``, saved to ``target``, be stored as a delta?"""
        with self._lock:
            previous = self._previous
            return (self.full_every > 1 and signature is not None and previous is not None and not self._broken
                    and self._deltas_in_chain < self.full_every - 1 and previous.signature == signature
                    and may_build_on(target, previous.target))

    def started(self, target: Any, staged: Future | None, signature: tuple | None, *, delta: bool) -> Hashable | None:
        """Record the save just started: a delta on the previous snapshot, or a new full (also a
        synchronous save, which keeps no snapshot). Returns the key of its base (None: a full)."""
        with self._lock:
            base = self._writing[target.key] = self._previous if delta else None
            if not delta:
                self._broken = False  # this save starts a new chain
            self._deltas_in_chain = self._deltas_in_chain + 1 if delta else 0
            self._previous = None if staged is None else _Snapshot(target, staged, signature)
            return None if base is None else base.target.key

    def same_state(self, target: Any, signature: tuple | None) -> Future | None:
        """The previous snapshot when ``target`` is another destination of that same state (same step,
        same tensors; its write has not failed), e.g. Lightning's ``last.ckpt`` saved right after the
        top-k file with no training in between; else None."""
        with self._lock:
            previous = self._previous
            if (previous is None or target.step is None or previous.target.step != target.step
                    or previous.target.key == target.key or previous.signature != signature
                    or previous.target.key in self._failed):
                return None
            return previous.staged

    def copied(self, target: Any) -> None:
        """Record a save of the previous snapshot to another destination: written whole, the chain unchanged."""
        with self._lock:
            self._writing[target.key] = None

    def forget(self, key: Hashable) -> None:
        """``key``'s checkpoint is going away: no later save builds on it."""
        with self._lock:
            if self._previous is not None and self._previous.target.key == key:
                self._previous = None

    def clear(self) -> None:
        """The pipeline is closing: drop the snapshots held as bases, so their buffers can go back."""
        with self._lock:
            self._previous = None
            self._writing.clear()

    def base_for(self, key: Hashable) -> DeltaBase | None:
        """The writer thread: the base ``key`` is encoded against (waits for its snapshot), or None."""
        with self._lock:
            base = self._writing.get(key)
            if base is not None and base.target.key in self._failed:  # queued before its base's write failed
                base = self._writing[key] = None
        return None if base is None else DeltaBase(base.target.step, base.target.name, base.staged.result())

    def finished(self, key: Hashable, failed: bool) -> None:
        """A write ended; after a failure no delta builds on it, so the next save is a full."""
        with self._lock:
            self._writing.pop(key, None)
            if failed:
                self._failed.add(key)
                self._broken = True

    def bases_in_flight(self) -> dict[Hashable, Hashable | None]:
        """Base key of every save being written (None for a full)."""
        with self._lock:
            return {key: None if base is None else base.target.key for key, base in self._writing.items()}
