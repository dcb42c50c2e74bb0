"""Which committed steps a retention policy deletes.

Keep the newest ``keep`` committed steps, plus every step that is a multiple of ``keep_every``.
Never delete the newest committed step, nor a step that is being written (``protected``).
"""

from __future__ import annotations


def steps_to_delete(
    committed: list[int], *, keep: int, keep_every: int | None = None, protected: set[int] = frozenset()
) -> list[int]:
    if keep < 1:
        raise ValueError("keep must be at least 1 (the newest committed step is never deleted)")
    ordered = sorted(set(committed))
    kept = set(ordered[-keep:]) | set(protected)
    if keep_every:
        kept |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in kept]
