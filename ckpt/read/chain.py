"""A delta chain followed link by link: the one walker of every loop over a checkpoint's bases — the
listing's chain check and the replicator's bases to copy (:mod:`ckpt.root`), retention's kept links,
``ckpt-copy``'s steps, ``ckpt inspect --verify`` (:func:`ckpt.inspect.report.chain_failures`) and a
load's base checkpoints (:class:`~ckpt.read.source.ChunkSource`, which opens them lazily)::

    for link in walk(start, base_of): ...        # start, its base, its base's base, ... (base_of: None ends it)
    for step in walk(step, listed_base(bases)):  # the same over a root's base map (step -> base step)
    check_link(seen, key)                        # the rule, for a chain walked one link at a time

A link met again (a loop) or a chain of more than :data:`MAX_CHAIN` links raises
:class:`ChainLoopError`, a :class:`~ckpt.errors.CorruptCheckpointError`: no manifest can make a walk
endless. Nothing here does I/O: ``base_of`` does, when its links are read as they are reached.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from typing import TypeVar

from ..errors import CorruptCheckpointError

MAX_CHAIN = 100_000  # links in one delta chain; real chains are full_every long (tens)

Link = TypeVar("Link")


class ChainLoopError(CorruptCheckpointError):
    """A delta chain that meets one of its links again (``limit`` None), or is longer than
    :data:`MAX_CHAIN` (``limit``: the bound); ``link`` is the key of the link that ended the walk."""

    def __init__(self, message: str = "", *, link: Hashable = None, limit: int | None = None, **fields):
        super().__init__(message, **fields)
        self.link, self.limit = link, limit


def check_link(seen: Collection, key: Hashable) -> None:
    """Raise :class:`ChainLoopError` when the link ``key`` is already among the links ``seen`` (a
    loop) or ``seen`` already holds :data:`MAX_CHAIN` links; else return, the link may be followed."""
    if key in seen:
        raise ChainLoopError(f"the delta chain loops: {key} is met twice", link=key)
    if len(seen) >= MAX_CHAIN:
        raise ChainLoopError(f"the delta chain is longer than {MAX_CHAIN} links at {key}", link=key, limit=MAX_CHAIN)


def walk(start: Link, base_of: Callable[[Link], Link | None], *,
         key: Callable[[Link], Hashable] = lambda link: link) -> Iterator[Link]:
    """``start``, then ``base_of(start)``, and so on until ``base_of`` returns None; each link is
    checked (:func:`check_link`, by ``key(link)``) before it is yielded, so a loop raises before its
    repeated link is handed out. ``base_of`` is called only when the walk goes on."""
    seen: set = set()
    link = start
    while link is not None:
        check_link(seen, key(link))
        seen.add(key(link))
        yield link
        link = base_of(link)


def listed_base(bases: Mapping) -> Callable[[int], int | None]:
    """``base_of`` for :func:`walk` over a root's base map (:meth:`~ckpt.root.steps.CheckpointRoot.bases`:
    step -> base step, None for a full checkpoint, or a marker for an unreadable manifest): a step's
    base step, or None where the chain ends (a full checkpoint, a step not in the map, an unreadable one)."""
    def base_of(step: int) -> int | None:
        base = bases.get(step)
        return base if isinstance(base, int) and not isinstance(base, bool) else None
    return base_of
