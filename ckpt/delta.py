"""Incremental checkpoints: when a save is a delta, and what it is a delta against.

Policy (``full_every = K``): a full checkpoint, then up to K-1 deltas, each against the previous
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

from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor

from .errors import InvalidOptionError
from .format import is_sibling_name
from .tree import leaves


def tensor_signature(state_dict: Any) -> tuple:
    """Shapes and dtypes of the (local) tensors of a state tree, in order: two snapshots with equal
    signatures have the same chunk layout."""
    tensors = (t for t in leaves(state_dict) if isinstance(t, torch.Tensor))
    return tuple((tuple(t.shape), t.dtype) for t in (t.to_local() if isinstance(t, DTensor) else t
                                                      for t in tensors))


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


class DeltaPolicy:
    """Decides, save by save, whether the next checkpoint may be a delta and against what."""

    def __init__(self, full_every: int):
        self.full_every = full_every
        self._previous: _Snapshot | None = None
        self._deltas_in_chain = 0
        self._broken = False

    def eligible(self, signature: tuple) -> bool:
        """This rank's view: may a snapshot with ``signature`` be stored as a delta?"""
        previous = self._previous
        return (self.full_every > 1 and previous is not None and not self._broken
                and self._deltas_in_chain < self.full_every - 1 and previous.signature == signature)

    def base_snapshot(self) -> tuple[int, Future]:
        """(step, staged state future) of the previous snapshot: the base of an agreed delta."""
        return self._previous.step, self._previous.staged

    def started(self, step: int, staged: Future, signature: tuple, *, delta: bool) -> None:
        """Record the save just started (a delta on the previous snapshot, or a new full)."""
        if not delta:
            self._broken = False  # this save starts a new chain
        self._deltas_in_chain = self._deltas_in_chain + 1 if delta else 0
        self._previous = _Snapshot(step, staged, signature)

    def write_failed(self) -> None:
        """A write failed: a delta must never build on it, so the next save is a full."""
        self._broken = True
