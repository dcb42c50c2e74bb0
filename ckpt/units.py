"""How sizes are shown to people. The tools: decimal SI units (:func:`human_bytes`: ``B``, ``kB``,
``MB``, ``GB``, ``TB``, ``PB``; powers of 1000, as disks and object stores count), one decimal above a
kilobyte. The trainer's lines: binary units (:func:`binary_bytes`: ``MiB`` below a GiB, ``GiB``
above), the family its memory figures (``mem 1.23 GiB``) and the resume's ``read 12.3 MiB`` use, so
every line of a run speaks one. Sizes a user types (``--max-shard-size 2GiB``) are parsed by the tools."""

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


def binary_bytes(size: int) -> str:
    """``10_400_000`` -> ``9.9 MiB``, ``3 * 2**30`` -> ``3.00 GiB``: MiB below a GiB, GiB from there."""
    if size < 2**30:
        return f"{size / 2**20:.1f} MiB"
    return f"{size / 2**30:.2f} GiB"
