"""A checkpoint assembled: the one place a manifest is built from what was written, and committed.

* :func:`new_manifest`: the header (step; kind, base step and base name from the delta base; world
  size; creation time; DCP version; user metadata; DCP's flatten mapping) and one entry, without
  chunks yet, per tensor (key, dtype, global shape). Every record (a
  :class:`~ckpt.format.Chunk` or :class:`~ckpt.format.ValueEntry` per written blob, see
  :class:`ckpt.write.files.Place`) then goes in with :meth:`Manifest.add_record`.
* :func:`build_manifest`: a save's manifest, from DCP's global metadata and every rank's write
  results (:class:`ckpt.dcp.Writer` on the coordinator, which then commits it with
  :func:`ckpt.commit.finish`: the ranks' writes span processes).
* :class:`NewCheckpoint`: a checkpoint one process writes outside a save — the offline
  converters (:mod:`ckpt.convert.replay`, :mod:`ckpt.convert.dcp.importer`, the Hugging Face import
  of :mod:`trainer.hf.importer`): a fresh commit attempt (:func:`ckpt.commit.begin`), data files
  written into it (:func:`ckpt.write.files.write_file`), each blob recorded at its place, then the
  manifest committed last (:func:`ckpt.commit.finish`) — or, on any failure, everything the
  attempt wrote removed (:func:`ckpt.commit.abort`).
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from .. import commit
from .delta import DeltaBase
from ..format import Manifest, TensorEntry, data_file_name
from ..storage import Location
from .files import Payload, write_file


def new_manifest(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]], *, step: int | None, world_size: int,
                 base: DeltaBase | None = None, created: float | None = None, dcp_version: str | None = None,
                 user: dict | None = None, paths: dict[str, tuple] | None = None, run: str | None = None) -> Manifest:
    """The manifest of a checkpoint being written, before its records: a full checkpoint, or a
    delta against ``base``; ``created`` defaults to now; one empty entry per ``(key, dtype, shape)``."""
    manifest = Manifest(world_size=world_size, created=time.time() if created is None else created,
                        dcp_version=dcp_version, step=step, kind="full" if base is None else "delta",
                        base_step=None if base is None else base.step, base=None if base is None else base.name,
                        user=dict(user or {}), paths=dict(paths or {}), run=run)
    for key, dtype, shape in tensors:
        manifest.tensors[key] = TensorEntry(dtype, tuple(shape), [])
    return manifest


def build_manifest(metadata: Metadata, results: list[list[WriteResult]], *, step: int | None,
                   base: DeltaBase | None, user: dict, run: str | None = None) -> Manifest:
    """The manifest of a save from DCP's global metadata and every rank's records (``run``: the
    identity of the run saving it, :mod:`ckpt.root.claim`)."""
    paths = {}
    if isinstance(metadata.planner_data, dict):
        paths = {key: tuple(path) for key, path in metadata.planner_data.items()
                 if isinstance(path, (tuple, list)) and all(type(p) in (str, int) for p in path)}
    manifest = new_manifest(((key, md.properties.dtype, md.size) for key, md in metadata.state_dict_metadata.items()
                             if isinstance(md, TensorStorageMetadata)),
                            step=step, world_size=len(results), base=base, dcp_version=metadata.version, user=user,
                            paths=paths, run=run)
    for rank_results in results:
        for result in rank_results:
            manifest.add_record(result.index.fqn, result.storage_data)
    manifest.sort_chunks()
    return manifest


class NewCheckpoint:
    """The checkpoint ``target`` written by this process: ``with NewCheckpoint(target, manifest,
    overwrite=...) as new: new.write(name, payloads)`` (each payload's key its :class:`Place`);
    committed when the block ends, removed when it raises (see the module docstring).

    ``manifest`` comes from :func:`new_manifest`; ``check``: a description of the source, when the
    manifest is built from foreign input and must be proven readable (parsed and validated as a
    reader would, ``Manifest.from_json``) before it is published. ``raw``: the manifest's bytes as
    committed, once the block ended.
    """

    def __init__(self, target: Location, manifest: Manifest, *, overwrite: bool, check: str | None = None):
        self.target, self.manifest, self.overwrite, self.check = target, manifest, overwrite, check
        self.attempt: commit.Attempt | None = None
        self.raw: bytes | None = None

    def __enter__(self) -> "NewCheckpoint":
        self.attempt = commit.begin(self.target, overwrite=self.overwrite)
        return self

    @property
    def tag(self) -> str:
        """The attempt's tag: data file names carry it on object stores (empty on POSIX)."""
        return self.attempt.tag

    def data_file(self, rank: int, part: int = 0) -> str:
        """The name of rank ``rank``'s data file ``part`` in this attempt."""
        return data_file_name(rank, part, self.attempt.tag)

    def write(self, name: str, payloads: Iterable[Payload]) -> None:
        """Write ``payloads`` into the data file ``name``, each blob recorded at its payload's place."""
        for place, blob in write_file(self.attempt.directory, name, payloads):
            self.manifest.add_record(place.key, place.record(blob))

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            commit.abort(self.attempt)
            return
        try:
            self.manifest.sort_chunks()
            raw = self.manifest.to_json()
            if self.check is not None:
                Manifest.from_json(raw, source=self.check)  # never publish what we would refuse
            commit.finish(self.attempt, self.manifest, overwrite=self.overwrite, raw=raw)
            self.raw = raw
        except BaseException:
            commit.abort(self.attempt)
            raise
