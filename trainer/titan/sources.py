"""A torchtitan checkpoint's flat state, read safely: where ``ckpt-convert``'s torchtitan paths read from.

Two kinds of source hold torchtitan's layout (model keys flat at the top, then ``optimizer.*``,
``lr_scheduler.*``, ``train_state.*``, ``dataloader.*``; :mod:`trainer.titan.convert`):

* a plain DCP ``step-N`` directory, as torchtitan's own ``CheckpointManager`` writes it (or its
  checkpoint folder: the newest such step, or a named one), read through the engine's DCP import
  (:func:`ckpt.convert.import_dcp`: ``.metadata`` by an allow-list unpickler, items with
  ``weights_only``; nothing executes code from the checkpoint);
* a step of ours (or its root), as :mod:`ckpt.integrations.torchtitan` writes it, read verified
  (every chunk's hash checked, deltas replayed).

Contract: :func:`read_source` returns one checkpoint's flat state by key, every tensor whole on the
CPU; with ``model_only`` the model's keys alone (:func:`is_model_key`), the other states not read.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import ckpt
from ckpt import CheckpointNotFoundError
from ckpt.convert import full_tensors, import_dcp
from ckpt.read import ChunkSource
from ckpt.root import resolve_checkpoint
from ckpt.storage import Location, locate

NOT_MODEL = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")  # torchtitan's other states
_TITAN_STEP = re.compile(r"^step-(\d+)$")


def is_model_key(key: str) -> bool:
    """Whether a key of torchtitan's checkpoint is its model's (flat at the top level)."""
    return not key.startswith(NOT_MODEL)


def step_of(name: str) -> int | None:
    """The step of a torchtitan ``step-N`` directory name (None for any other name)."""
    match = _TITAN_STEP.match(name)
    return int(match.group(1)) if match else None


def titan_step_dir(src: str | os.PathLike, step: int | None = None) -> Path:
    """The torchtitan checkpoint ``src`` names: itself when it is a DCP directory, else its
    ``step-N`` directory (``step``, default the newest holding a ``.metadata``)."""
    path = Path(src)
    if (path / ".metadata").is_file() and step is None:
        return path
    found = {int(m.group(1)): p for p in (path.iterdir() if path.is_dir() else ())
             if (m := _TITAN_STEP.match(p.name)) and (p / ".metadata").is_file()}
    if not found:
        raise CheckpointNotFoundError(f"{path} is neither a torchtitan checkpoint (a DCP directory with .metadata) "
                                      "nor a torchtitan checkpoint folder (step-N directories)", path=str(path))
    if step is not None and step not in found:
        raise CheckpointNotFoundError(f"{path} has no torchtitan step {step} (it has {', '.join(map(str, sorted(found)))})",
                                      path=str(path))
    return found[max(found) if step is None else step]


def read_all(location: Location) -> dict[str, Any]:
    """Every tensor (whole) and value of one of our checkpoints (its location, resolved by the caller), by flat key."""
    manifest = ckpt.read_manifest(location)
    flat: dict[str, Any] = dict(full_tensors(location, manifest=manifest))
    with ChunkSource(location, manifest) as source:
        for key, entry in manifest.values.items():
            flat[key] = source.value(key, entry)
    return flat


def _read_dcp(step_dir: Path, model_only: bool) -> dict[str, Any]:
    """A torchtitan DCP step's flat state, imported (pickle-free) into a temporary checkpoint of ours."""
    with tempfile.TemporaryDirectory(prefix=".titan-import-") as tmp:
        imported = locate(Path(tmp) / "imported")  # resolved once: written, then read
        import_dcp(step_dir, imported, keys=is_model_key if model_only else None)
        return read_all(imported)


def read_source(src: str | os.PathLike, step: int | None = None,
                model_only: bool = False) -> tuple[str, dict[str, Any], int | None]:
    """(the step read, its flat state, the step number it names) of the torchtitan checkpoint ``src``:
    a DCP step (or folder) first, else a checkpoint of ours (or root); ``step`` picks one of a folder
    or root (default the newest). A source that is neither raises the DCP reading's
    CheckpointNotFoundError, which says what was looked for."""
    try:
        step_dir = titan_step_dir(src, step)
    except CheckpointNotFoundError as not_dcp:
        try:
            source = resolve_checkpoint(os.fspath(src), step)
        except CheckpointNotFoundError:
            raise not_dcp from None
        manifest = ckpt.read_manifest(source)
        if not model_only:
            return str(source), read_all(source), manifest.step
        keys = [key for key in manifest.tensors if is_model_key(key)]
        return str(source), dict(full_tensors(source, keys, manifest=manifest)), manifest.step
    return str(step_dir.resolve()), _read_dcp(step_dir, model_only), step_of(step_dir.name)


__all__ = ["NOT_MODEL", "is_model_key", "read_all", "read_source", "step_of", "titan_step_dir"]
