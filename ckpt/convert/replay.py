"""Materialise a checkpoint of a delta chain as an equivalent full checkpoint.

Every chunk is decoded through its chain (all links verified) and stored raw in a data file of the
same name as before, so the layout (ranks, chunks) is unchanged; values are copied. The result is
committed with the usual protocol (:class:`ckpt.write.assemble.NewCheckpoint`), at a new path or in place
of the source (atomically; deltas that use the source as their base stay valid because the raw
bytes are identical). An output named as a step (``step-00000400``) must be the source's step:
step 450 is never stored under step 400's name (refused before anything is written).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable

from ..write.assemble import NewCheckpoint, new_manifest
from ..errors import CheckpointError
from ..format import Chunk, Manifest, numbered_file_name, parse_step_name, step_name
from ..read.source import ChunkSource
from ..storage import locate
from ..write.files import Payload, Place


def materialize(source_path: str | os.PathLike, out: str | os.PathLike | None = None, *,
                overwrite: bool = False, progress: Callable[[int], None] | None = None,
                storage_options: dict | None = None) -> Manifest:
    """Write ``source_path`` (any checkpoint; a path or URL) as a full checkpoint at ``out``
    (default: in place).

    ``progress(n)`` is called with the raw bytes of each chunk as it is written."""
    source_path = locate(source_path, storage_options)
    out = source_path if out is None else locate(out, storage_options)
    in_place = out.storage is source_path.storage and \
        out.storage.identity(out.path) == source_path.storage.identity(source_path.path)
    with ChunkSource(source_path) as source:
        old = source.manifest
        named = parse_step_name(out.name)
        if named is not None and old.step is not None and named != old.step:  # before anything is replaced
            raise CheckpointError(f"refusing to write step {old.step} as {out}: that name is step {named}'s; "
                                  f"name the output {step_name(old.step)} or a directory that is not a step's",
                                  path=str(out))
        manifest = new_manifest(((key, e.dtype, e.shape) for key, e in old.tensors.items()), step=old.step,
                                world_size=old.world_size, created=old.created, dcp_version=old.dcp_version,
                                user=old.user, paths=old.paths, run=old.run)
        for key, value in old.values.items():
            if value.blob is None:
                manifest.add_record(key, value)
        with NewCheckpoint(out, manifest, overwrite=overwrite or in_place) as new:
            by_file: dict[str, list[Payload]] = defaultdict(list)
            for key, entry in old.tensors.items():
                for chunk in entry.chunks:
                    by_file[chunk.blob.file].append(Payload(Place(key, chunk.offsets, chunk.sizes),
                                                            _decoder(source, key, chunk, progress),
                                                            chunk.blob.decoded_length))
            for key, value in old.values.items():
                if value.blob is not None:
                    by_file[value.blob.file].append(
                        Payload(Place(key, encoding=value.encoding),
                                lambda value=value, key=key: source.files.read(value.blob, what=key), 0))
            for number, (old_name, payloads) in enumerate(sorted(by_file.items())):
                # object stores: names unique to this attempt (see ckpt.commit)
                new.write(numbered_file_name(number, new.tag) if new.tag else old_name, payloads)
    return manifest


def _decoder(source: ChunkSource, key: str, chunk: Chunk, progress):
    def produce():
        raw = source.raw(key, chunk)
        if progress is not None:
            progress(raw.nbytes)
        return raw

    return produce
