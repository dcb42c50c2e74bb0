"""Limits on what a foreign checkpoint (DCP's ``.metadata`` and data files) may make this process do.

Contract: :func:`check_structure` walks an unpickled object iteratively (never a RecursionError)
and refuses, with the given error type, a structure with more elements than its pickle could hold
without memo sharing (a DAG of shared lists unpickles in linear time but explodes when anything
walks it: 2^40 leaves from 40 lists, 2500 tensors sharing one 2500-chunk list), nested deeper than
``max_depth``, holding a string that is not valid Unicode (a lone surrogate imports, then breaks
every tool printing it), or a tensor that is not on the CPU (a meta tensor has no data);
:func:`available_memory` is the memory an item may take (``MemAvailable``), against which declared
sizes are checked before anything is allocated (:func:`check_memory`); :func:`check_pickle_ends`
looks at a pickle file's first and last bytes before it is read whole.
"""

from __future__ import annotations

import dataclasses
import os
import pickletools

import torch

from ...errors import CheckpointError, CorruptCheckpointError

ELEMENTS_PER_BYTE = 4  # a pickle spends >= 1 byte per element; a memo GET (2 bytes) may stand for a small Size
SLACK_ELEMENTS = 4096
_OPCODES = frozenset(ord(op.code) for op in pickletools.opcodes)
_LEAVES = (int, float, bool, complex, bytes, bytearray, type(None), torch.dtype, torch.layout, torch.memory_format)


def element_budget(pickled_bytes: int) -> int:
    """The most elements a pickle of ``pickled_bytes`` holds without a memo-shared structure."""
    return ELEMENTS_PER_BYTE * pickled_bytes + SLACK_ELEMENTS


def check_structure(obj, *, budget: int, max_depth: int, what: str, error: type[CheckpointError], **where) -> None:
    """Refuse (``error(message, **where)``) a structure with more than ``budget`` elements counted
    as a walk would meet them (a shared object once per reference), deeper than ``max_depth``, with
    a string that is not valid Unicode, or with a tensor not on the CPU. Each distinct object is
    visited once (sizes of shared ones memoised), so the check itself is linear in the pickle."""
    sizes: dict[int, tuple[int, int]] = {}  # id -> (elements below and including it, depth below it)
    keep = []  # the objects whose ids are in sizes stay alive
    stack = [(obj, False)]
    while stack:
        value, done = stack.pop()
        key = id(value)
        if done:
            children = _children(value)
            known = [sizes.get(id(c), (1, 0)) for c in children]  # a back edge of a cycle counts once
            total = 1 + sum(n for n, _ in known)
            depth = 1 + max((d for _, d in known), default=0)
            if total > budget:
                raise error(f"{what} holds more than {budget} elements for its size (a memo-shared structure "
                            "that explodes when walked); refused", **where)
            if depth > max_depth:
                raise error(f"{what} is nested more than {max_depth} levels deep", **where)
            sizes[key] = (total, depth)
            continue
        if key in sizes:
            continue
        kind = type(value)
        if kind in _LEAVES:
            continue
        if kind is str:
            _check_text(value, what, error, where)
            continue
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise error(f"{what} holds a tensor on the {value.device.type} device (no data to import)", **where)
            continue
        children = _children(value)
        if children is None:
            continue
        sizes[key] = (1, 0)  # in progress: a cycle back to it counts once
        keep.append(value)
        stack.append((value, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
        if len(stack) > budget:
            raise error(f"{what} holds more than {budget} elements for its size; refused", **where)


def _children(value) -> list | None:
    if isinstance(value, dict):
        return [c for pair in value.items() for c in pair]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
        return list(vars(value).values())
    return None


def _check_text(text: str, what: str, error: type[CheckpointError], where: dict) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{what} holds the string {ascii(text)[:120]}, which is not valid Unicode (a lone "
                    "surrogate); refused", **where) from None


def available_memory() -> int | None:
    """The bytes this machine can still give a process (``MemAvailable``), or None when unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(nbytes: int, what: str, **where) -> None:
    """Refuse an item that would need ``nbytes`` in memory when the machine has less available."""
    available = available_memory()
    if available is not None and nbytes > available:
        raise CheckpointError(f"{what} needs {nbytes} bytes in memory; this machine has {available} available "
                              "(a declared size no real item of it can have here); refused before allocating",
                              **where)


def check_pickle_ends(path, name: str, limit: int) -> None:
    """Before the pickle ``path/name`` is read whole: it begins with a pickle opcode and ends with
    ``STOP``, and fits in memory; a sparse or foreign file of gigabytes is refused from its ends."""
    handle = path.storage.open_read(path.path, name)
    try:
        size, head, tail = handle.size, bytearray(2), bytearray(1)
        handle.read_into(memoryview(head), 0)
        handle.read_into(memoryview(tail), max(size - 1, 0))
    finally:
        handle.close()
    if size < 2 or head[0] not in _OPCODES or tail != b".":
        raise CorruptCheckpointError(f"{path / name} is not a pickle (it does not begin and end as one)",
                                     path=str(path), file=name)
    if size <= limit:
        check_memory(size, str(path / name), path=str(path), file=name)
