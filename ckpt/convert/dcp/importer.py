"""Import a checkpoint written by plain ``torch.distributed.checkpoint`` (DCP's ``FileSystemWriter``,
what torchtitan and most PyTorch trainers write) as a checkpoint of our format.

DCP's directory: ``.metadata`` (a pickle: :mod:`ckpt.convert.dcp.metadata` reads it with an
allow-list unpickler) and ``__<rank>_<n>.distcp`` data files (:mod:`ckpt.convert.dcp.items` reads
their items with ``torch.load(weights_only=True)``). Both halves execute code from a hostile
checkpoint when DCP itself reads them; here what would need code execution raises
:class:`~ckpt.errors.UnsafeCheckpointError`. :func:`import_dcp` matches every stored item to its
place in the metadata (each declared chunk and value stored exactly once, inside its shape, in a
data file below the directory), checks every chunk against the metadata (dtype, box), stores it
raw with DCP's chunk boxes (so the result reshards like any of ours), and commits the result
(:class:`ckpt.write.assemble.NewCheckpoint`: nothing partial is ever visible).
"""

from __future__ import annotations

import math
import os
import re
from typing import Callable

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ...write.assemble import NewCheckpoint, new_manifest
from ...read.committed import DCP_METADATA_NAME as METADATA_NAME
from ...errors import CheckpointExistsError, CorruptCheckpointError, InvalidManifestError, UnsupportedFormatError
from ...format import Manifest, ValueEntry, dtype_name, parse_step_name
from ...storage import Location, locate
from ...write.files import Payload, Place
from .bounds import check_memory
from .items import STREAM_SLACK, Item, ItemReader, transform
from .metadata import read_dcp_metadata

_DCP_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


def import_dcp(src: str | os.PathLike | Location, dst: str | os.PathLike | Location, *, overwrite: bool = False,
               progress: Callable[[int], None] | None = None, storage_options: dict | None = None,
               keys: Callable[[str], bool] | None = None) -> Manifest:
    """Convert the DCP FileSystemWriter checkpoint directory ``src`` into a checkpoint of ours at
    ``dst`` (a step directory such as ``ckpts/step-00000100``; its step is taken from that name).

    Streams chunk by chunk: each tensor chunk is read from its ``.distcp`` file, decoded with
    ``torch.load(weights_only=True)``, checked against the metadata's dtype and box, and stored raw
    with DCP's box; non-tensor values become tagged JSON where possible (else a ``torch.save``
    stream proven to load with ``weights_only=True``); DCP's flatten mapping becomes the manifest's
    ``paths``. Committed atomically (:mod:`ckpt.commit`); ``overwrite`` replaces a committed ``dst``.
    ``progress(n)`` is called with the raw bytes of each tensor chunk once it is decoded. ``keys``:
    import only the keys it accepts (a trainer checkpoint's model weights alone); the metadata is
    checked whole all the same, and data files holding none of them are not opened.

    Raises :class:`UnsafeCheckpointError` (something would need code execution to load),
    :class:`CorruptCheckpointError` (a truncated or inconsistent checkpoint, a data file path
    leaving ``src``), :class:`UnsupportedFormatError` (a transform or serialization this cannot
    read, a dtype our format cannot store)."""
    src, dst = locate(src, storage_options), locate(dst, storage_options)
    if src.storage is dst.storage and src.storage.identity(src.path) == dst.storage.identity(dst.path):
        raise CheckpointExistsError(f"{dst} is the DCP checkpoint being converted; choose another destination",
                                    path=str(dst))
    metadata = read_dcp_metadata(src)
    wanted = keys or (lambda key: True)
    items = [item for item in _plan(src, metadata) if wanted(item.key)]
    by_file: dict[str, list[Item]] = {}
    for item in items:
        by_file.setdefault(item.info.relative_path, []).append(item)
    _check_file_sizes(src, by_file)
    names, world = _output_names(sorted(by_file))
    tensors = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and wanted(key):
            try:
                dtype_name(md.properties.dtype)  # refuses dtypes the format cannot store, before any work
            except UnsupportedFormatError as exc:
                raise UnsupportedFormatError(f"{src}: {key}: {exc}", path=str(src), file=METADATA_NAME,
                                             tensor=key) from None
            tensors.append((key, md.properties.dtype, md.size))
    manifest = new_manifest(tensors, step=parse_step_name(dst.name), world_size=world, dcp_version=metadata.version,
                            user={"converted_from": "dcp"},
                            paths={k: v for k, v in _paths(metadata).items() if wanted(k)})
    reader = ItemReader(src)
    try:
        with NewCheckpoint(dst, manifest, overwrite=overwrite, check=f"{dst} (converted from {src})") as new:
            for rel_path in sorted(by_file):
                payloads = []
                for item in sorted(by_file[rel_path], key=lambda i: i.info.offset):
                    if item.offsets is None:
                        record = reader.value(item)
                        if isinstance(record, ValueEntry):
                            manifest.add_record(item.key, record)
                            continue
                        payloads.append(Payload(Place(item.key), lambda record=record: record, len(record)))
                    else:
                        payloads.append(Payload(Place(item.key, item.offsets, item.sizes),
                                                lambda item=item: reader.chunk(item, progress), 0))
                if payloads:
                    new.write(new.data_file(*names[rel_path]), payloads)  # tagged on object stores (ckpt.commit)
    finally:
        reader.close()
    return manifest


def _paths(metadata: Metadata) -> dict[str, tuple]:
    """DCP's flatten mapping (key -> path in the nested state) for the keys it stored."""
    mapping = metadata.planner_data
    if not isinstance(mapping, dict):
        return {}
    return {key: tuple(path) for key, path in mapping.items()
            if key in metadata.state_dict_metadata and type(path) in (tuple, list)
            and all(type(p) in (str, int) for p in path)}


def _plan(src: Location, metadata: Metadata) -> list[Item]:
    """One item per stored chunk or value, each matched to its place in the metadata; every chunk
    and value the metadata declares must be stored exactly once."""
    where = dict(path=str(src), file=METADATA_NAME)
    boxes: dict[str, dict[tuple, tuple]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            shape = tuple(md.size)
            boxes[key] = {}
            for chunk in md.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                        any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
                    raise InvalidManifestError(f"{src}: {key}: chunk at {list(offsets)} size {list(sizes)} lies "
                                               f"outside its shape {list(shape)}", tensor=key, **where)
                if offsets in boxes[key]:
                    raise InvalidManifestError(f"{src}: {key}: two chunks at {list(offsets)}", tensor=key, **where)
                boxes[key][offsets] = sizes
            if sum(math.prod(s) for s in boxes[key].values()) != math.prod(shape):
                raise InvalidManifestError(f"{src}: {key}: chunks do not cover its shape {list(shape)}",
                                           tensor=key, **where)
    items, seen = [], set()
    for index, info in metadata.storage_data.items():
        key = index.fqn
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            raise InvalidManifestError(f"{src}: stored item {key!r} is not in the state dict metadata",
                                       tensor=key, **where)
        _check_relative_path(src, key, info.relative_path)
        for descriptor in info.transform_descriptors or ():
            transform(descriptor, src, key)
        if isinstance(md, BytesStorageMetadata):
            items.append(Item(key, info))
            seen.add((key, None))
            continue
        offsets = tuple(index.offset) if index.offset is not None else None
        if offsets not in boxes[key]:
            raise InvalidManifestError(f"{src}: stored chunk of {key!r} at {offsets} is not one of its chunks",
                                       tensor=key, **where)
        items.append(Item(key, info, offsets, boxes[key][offsets], md.properties.dtype))
        seen.add((key, offsets))
    for key, md in metadata.state_dict_metadata.items():
        wanted = [(key, None)] if isinstance(md, BytesStorageMetadata) else [(key, o) for o in boxes[key]]
        for want in wanted:
            if want not in seen:
                raise CorruptCheckpointError(f"{src}: {key!r} (chunk at {want[1]}) is declared but not stored",
                                             tensor=key, **where)
    return items


def _check_relative_path(src: Location, key: str, rel: str) -> None:
    """A data file named by the metadata lies below ``src``: plain names, no ``..``, no absolute path."""
    parts = rel.split("/")
    if len(parts) > 8 or not all(_PATH_PART.fullmatch(p) for p in parts) or rel == METADATA_NAME:
        raise InvalidManifestError(f"{src}: {key!r} names the data file {rel!r}, which is not a plain file name "
                                   f"inside the checkpoint; refused", path=str(src), file=METADATA_NAME, tensor=key)


def _check_file_sizes(src: Location, by_file: dict[str, list[Item]]) -> None:
    """A data file too short for an item it should hold, an untransformed chunk stored in fewer
bytes than its box holds, or an item that cannot fit in this machine's memory is refused before
any work is done."""
    for rel, items in by_file.items():
        handle = src.storage.open_read(src.path, rel)
        try:
            size = handle.size
        finally:
            handle.close()
        for item in items:
            end = item.info.offset + item.info.length
            where = dict(path=str(src), file=rel, tensor=item.key)
            if end > size:
                raise CorruptCheckpointError(
                    f"{src}: {rel} is truncated ({size} bytes) - {item.key} needs bytes {item.info.offset}..{end}",
                    **where)
            nbytes = 0 if item.offsets is None else math.prod(item.sizes) * item.dtype.itemsize
            if not item.info.transform_descriptors and item.info.length < nbytes:
                raise CorruptCheckpointError(f"{src}: the chunk of {item.key!r} at {list(item.offsets)} declares "
                                             f"{nbytes} bytes but {rel} stores {item.info.length} for it", **where)
            held = item.info.length + (nbytes + STREAM_SLACK if item.info.transform_descriptors and nbytes else 0)
            check_memory(held, f"{src}: the item {item.key!r} in {rel}", **where)


def _output_names(rel_paths: list[str]) -> tuple[dict[str, tuple[int, int]], int]:
    """The (rank, part) of our data file for each DCP one (``__3_1.distcp`` -> rank 3, part 1:
    ``data/rank-00003-p1.bin``; other names become further parts of rank 0), and the number of
    ranks that wrote. Two names of one (rank, part) (``__0_1``, ``__0_01``): the second is treated
like other names."""
    names, used, others = {}, set(), []
    for rel in rel_paths:
        match = _DCP_FILE.fullmatch(rel)
        if match and int(match.group(1)) < (1 << 24) and (int(match.group(1)), int(match.group(2))) not in used:
            rank, part = int(match.group(1)), int(match.group(2))
            names[rel] = (rank, part)
            used.add((rank, part))
        else:
            others.append(rel)
    part = 0
    for rel in others:
        while (0, part) in used:
            part += 1
        names[rel] = (0, part)
        used.add((0, part))
    world = 1 + max((rank for rank, _ in used), default=0)
    return names, world
