"""Every name the format gives to a directory or file, and its parser, in one place (docs/FORMAT.md).

    <root>/step-00000100/                   a step's checkpoint            step_name / parse_step_name
    <root>/step-00000100.tmp-<id>/          a save in progress (or dead)   attempt_name / leftover_target
    <root>/step-00000100.old-<id>/          a committed copy moved aside   aside_name / leftover_target
    <root>/step-00000100.damaged-<time>/    a step no mount could load     damaged_name / parse_damaged_name
      manifest.json                         MANIFEST_NAME
      data/rank-00003.bin                   data_file_name / data_file_rank / is_data_file_name
      data/rank-00003-p1.bin                (a rank's further parts)
      data/<tag>.rank-00003.bin             (object stores: tagged by the save attempt)
      data/<tag>.file-00002.bin             numbered_file_name (a rewritten checkpoint, object stores)

A delta's ``base`` names a sibling checkpoint: one path component (:func:`is_sibling_name`).
Nothing here touches storage; the parsers accept exactly what the makers produce (and what readers
of older checkpoints must accept), so a hostile name never reaches a path.
"""

from __future__ import annotations

import re
from typing import Any

MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
TMP_MARK = ".tmp-"  # <name>.tmp-<id>: an attempt in progress (POSIX), invisible to readers
OLD_MARK = ".old-"  # <name>.old-<id>: a committed copy moved aside by an overwriting save
DAMAGED_MARK = ".damaged-"  # <name>.damaged-<time>: set aside for a person, never loaded, never deleted

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_DAMAGED_DIR = re.compile(r"^step-(\d{8,})\.damaged-(\d{8}T\d{6}Z(?:-\d+)?)$")
_DATA_FILE = re.compile(r"^data/[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.bin$")
_RANK = re.compile(r"rank-(\d+)")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SIBLING = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # one path component, no "..", no "/"


# -- step directories ----------------------------------------------------------------------------
def step_name(step: int) -> str:
    """The directory name of a step's checkpoint: ``step-00000100``."""
    return f"step-{step:08d}"


def parse_step_name(name: str) -> int | None:
    """The step of a step directory's name (``step-00000100`` -> 100), None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def attempt_name(name: str, tag: str) -> str:
    """Where an attempt to write ``name`` goes on POSIX until it commits: ``<name>.tmp-<tag>``."""
    return f"{name}{TMP_MARK}{tag}"


def aside_name(name: str, tag: str) -> str:
    """Where a committed ``name`` is moved while a save replaces it: ``<name>.old-<tag>``."""
    return f"{name}{OLD_MARK}{tag}"


def damaged_name(step: int, when: str) -> str:
    """Where a committed step that no mount could load is set aside: ``step-00000100.damaged-<when>``
    (``when``: UTC ``20261205T130501Z``, ``-2`` etc. appended when that name is taken). Not a step
    for readers, not a leftover for clean-up: it stays until a person removes it."""
    return f"{step_name(step)}{DAMAGED_MARK}{when}"


def parse_damaged_name(name: str) -> tuple[int, str] | None:
    """``(step, when)`` of a set-aside step's name (``step-00000100.damaged-20261205T130501Z``), else None."""
    match = _DAMAGED_DIR.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def is_leftover(name: str) -> bool:
    """Whether ``name`` is an attempt's or a moved-aside copy's (never a checkpoint for readers)."""
    return TMP_MARK in name or OLD_MARK in name


def leftover_target(name: str) -> str | None:
    """The name a leftover belongs to (``step-00000100.tmp-ab12`` -> ``step-00000100``), else None."""
    for mark in (TMP_MARK, OLD_MARK):
        if mark in name:
            return name.split(mark, 1)[0]
    return None


def step_of_entry(name: str) -> int | None:
    """The step of a step directory or of its leftovers (``step-00000100.tmp-ab12`` -> 100)."""
    return parse_step_name(leftover_target(name) or name)


# -- data files ----------------------------------------------------------------------------------
def data_file_name(rank: int, part: int = 0, tag: str = "") -> str:
    """Relative name of a rank's data file: ``data/rank-00003.bin`` (``-p1`` etc. for extra parts;
    on object stores prefixed by the save attempt's tag: ``data/<tag>.rank-00003.bin``)."""
    return f"{DATA_DIR}/" + (f"{tag}." if tag else "") + f"rank-{rank:05d}" + (f"-p{part}" if part else "") + ".bin"


def numbered_file_name(number: int, tag: str) -> str:
    """A data file of a checkpoint rewritten on an object store, numbered within the attempt
    ``tag``: ``data/<tag>.file-00002.bin``."""
    return f"{DATA_DIR}/{tag}.file-{number:05d}.bin"


def data_file_rank(name: str) -> int | None:
    """The rank that wrote the data file ``name`` (``data/<tag>.rank-00003-p1.bin`` -> 3), None
    when its name does not say."""
    match = _RANK.search(name.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def is_data_file_name(name: Any) -> bool:
    """A data file name a manifest may hold: ``data/`` and one safe component ending ``.bin``."""
    return isinstance(name, str) and _DATA_FILE.fullmatch(name) is not None


def is_sibling_name(name: Any) -> bool:
    """A delta's base: one path component beside the checkpoint (no "..", no separators)."""
    return isinstance(name, str) and _SIBLING.fullmatch(name) is not None


def is_run_id(name: Any) -> bool:
    """A run identity (a manifest's ``run``, a mount's ``.run`` claim): 1 to 64 of ``[A-Za-z0-9._-]``."""
    return isinstance(name, str) and _RUN_ID.fullmatch(name) is not None
