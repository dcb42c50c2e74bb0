"""How sizes are shown to people: one convention for every tool and the trainer — decimal SI units
(``B``, ``kB``, ``MB``, ``GB``, ``TB``, ``PB``; powers of 1000, as disks and object stores count),
one decimal above a kilobyte. Sizes a user types (``--max-shard-size 2GiB``) are parsed by the tools."""

from __future__ import annotations

_UNITS = ("kB", "MB", "GB", "TB", "PB")


def human_bytes(size: int | None) -> str:
    """``532`` -> ``532 B``, ``10_400_000`` -> ``10.4 MB``; None -> ``-``."""
    if size is None:
        return "-"
    if size < 1000:
        return f"{size} B"
    value = float(size)
    for unit in _UNITS:
        value /= 1000
        if value < 999.95 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")
