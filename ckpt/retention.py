"""Which committed steps a retention policy deletes.

Keep the newest ``keep`` committed steps, plus every step that is a multiple of ``keep_every``.
Never delete the newest committed step, nor a step that is being written (``protected``), nor any
link of the delta chain of a kept step (``bases`` maps a delta step to its base step).
"""

from __future__ import annotations

from collections.abc import Mapping


def steps_to_delete(
    committed: list[int],
    *,
    keep: int,
    keep_every: int | None = None,
    protected: set[int] = frozenset(),
    bases: Mapping[int, int | None] | None = None,
) -> list[int]:
    if keep < 1:
        raise ValueError("keep must be at least 1 (the newest committed step is never deleted)")
    ordered = sorted(set(committed))
    kept = set(ordered[-keep:]) | set(protected)
    if keep_every:
        kept |= {s for s in ordered if s % keep_every == 0}
    pending = list(kept)
    while pending and bases:
        base = bases.get(pending.pop())
        if base is not None and base not in kept:
            kept.add(base)
            pending.append(base)
    return [s for s in ordered if s not in kept]
