"""Steps that no mount can load, set aside where a person can look at them.

    set_aside(mount, step, when) -> Location | None    step-N moved to step-N.damaged-<when> on that mount
    damaged_steps(path) -> [(step, name)]               what a root holds set aside (ckpt inspect lists it)

A committed step that failed verification on every mount holding it is not history the run can go
back to: left under its name it would stop the run at the next start (it is newer than what loads)
and be taken again for "the newest step" by every tool. :mod:`ckpt.root.resume` sets it aside on
each mount that holds it, after every rank agreed that each copy is damaged — never for an
unreachable mount or an incompatible state. Set aside is moved, never deleted: the name
(:func:`ckpt.format.damaged_name`) is neither a step for readers nor a leftover for clean-up, so the
engine never loads or removes it; training through that step again writes a fresh one.

POSIX: one rename of the directory, the parent fsync'd (atomic). Object stores (no rename): every
object copied under the new prefix, the manifest last, then the step deleted manifest first
(:func:`ckpt.commit.delete`); a crash in between leaves the step committed as it was and a partial
copy beside it, which stays (a person's to remove) and is never read.
"""

from __future__ import annotations

import time

from .. import commit
from ..format import MANIFEST_NAME, damaged_name, parse_damaged_name, step_name
from ..storage import Location

COPY_PIECE = 8 << 20  # an object store's set-aside copy streams this much at a time


def utc_stamp(now: float | None = None) -> str:
    """``20261205T130501Z``: when a step was set aside, in its name."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))


def set_aside(mount: Location, step: int, when: str) -> Location | None:
    """Move committed ``step`` under ``mount`` to ``step-N.damaged-<when>`` (``-2``, ``-3`` ...
    appended when taken); the new location, or None when the step is no longer committed there."""
    source = mount / step_name(step)
    if not commit.is_committed(source):
        return None
    taken = set(mount.list())
    name, n = damaged_name(step, when), 1
    while name in taken:
        n += 1
        name = damaged_name(step, f"{when}-{n}")
    target = mount / name
    storage = mount.storage
    if storage.atomic_rename:
        storage.rename(source.path, target.path)
        storage.sync_dir(mount.path)
        return target
    _copy_tree(source, target)
    commit.delete(source)
    return target


def damaged_steps(path: Location) -> list[tuple[int, str]]:
    """``(step, name)`` of every step set aside under the root ``path``, by step then name."""
    found = []
    for name in path.list():
        parsed = parse_damaged_name(name)
        if parsed is not None:
            found.append((parsed[0], name))
    return sorted(found)


def _copy_tree(source: Location, target: Location) -> None:
    """Every object under ``source`` to the same name under ``target``, the manifest last."""
    names = _files(source, "")
    names.sort(key=lambda name: name == MANIFEST_NAME)
    for name in names:
        _copy_file(source, target, name)


def _files(directory: Location, prefix: str) -> list[str]:
    names = []
    for name in directory.list():
        entry = directory / name
        if entry.is_dir():
            names += _files(entry, f"{prefix}{name}/")
        else:
            names.append(prefix + name)
    return names


def _copy_file(source: Location, target: Location, name: str) -> None:
    directory, _, base = f"{source.path}/{name}".rpartition("/")
    reader = source.storage.open_read(directory, base)
    out = target.storage.create(f"{target.path}/{name}")
    try:
        buffer = bytearray(min(COPY_PIECE, max(reader.size, 1)))
        position = 0
        while position < reader.size:
            view = memoryview(buffer)[: min(len(buffer), reader.size - position)]
            got = reader.read_into(view, position)
            if got <= 0:
                break
            out.write(view[:got])
            position += got
        out.close()
    except BaseException:
        out.abort()
        raise
    finally:
        reader.close()
