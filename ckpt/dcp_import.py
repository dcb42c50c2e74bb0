"""Import a checkpoint written by plain ``torch.distributed.checkpoint`` (DCP's ``FileSystemWriter``,
what torchtitan and most PyTorch trainers write) as a checkpoint of our format.

DCP's on-disk format (torch 2.13, ``FileSystemWriter`` with its default ``TORCH_SAVE`` serialization):

    <dir>/.metadata              ``pickle.dump`` of a ``Metadata``: ``state_dict_metadata`` (key ->
                                 TensorStorageMetadata(dtype, global size, chunk boxes) or
                                 BytesStorageMetadata), ``planner_data`` (key -> path in the nested
                                 state: DCP's flatten mapping), ``storage_data`` (MetadataIndex(key,
                                 chunk offsets) -> _StorageInfo(relative_path, offset, length,
                                 transform_descriptors)), ``storage_meta``, ``version``
    <dir>/__<rank>_<n>.distcp    per rank (``n``: one file per writer thread, or per item), items
                                 back to back: each tensor chunk a ``torch.save`` stream (a zip) of
                                 the chunk as a tensor, each non-tensor value a ``torch.save`` of the
                                 value; each optionally passed through stream transforms (only
                                 ``stream.zstd/1`` exists) listed in ``transform_descriptors``

Both halves execute code from a hostile checkpoint when DCP itself reads them: ``.metadata`` with
``pickle.load``, values with ``torch.load(weights_only=False)``. Here ``.metadata`` is read by an
allow-list unpickler (:func:`read_dcp_metadata`, see :class:`_MetadataUnpickler` for exactly what it
admits) and every item with ``torch.load(weights_only=True)`` on exactly the item's bytes; what those
refuse raises :class:`~ckpt.errors.UnsafeCheckpointError`. Every chunk is checked against the metadata
(dtype, box), stored raw with DCP's chunk boxes (so the result reshards like any of ours), and the
result is committed with :mod:`ckpt.commit` (nothing partial is ever visible).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pathlib
import pickle
import re
import time
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch
import zstandard
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from . import commit
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    InvalidManifestError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from .committed import DCP_METADATA_NAME as METADATA_NAME
from .format import (
    MAX_BYTES,
    MAX_DIMS,
    Chunk,
    Manifest,
    TensorEntry,
    ValueEntry,
    data_file_name,
    dtype_name,
    parse_step_name,
    values,
)
from .storage import Location, locate
from .write import Payload, tensor_bytes, write_file

MAX_METADATA_BYTES = 1 << 32
MAX_VALUE_BYTES = 1 << 30  # a decompressed non-tensor value
STREAM_SLACK = 1 << 20  # a torch.save zip around a chunk's bytes: headers, data.pkl, 64-byte padding
ZSTD = "stream.zstd"
_ZIP_MAGIC = b"PK\x03\x04"
_DCP_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


# -- .metadata: the allow-list unpickler ---------------------------------------------------------

def _layout(name):
    """``torch.serialization._get_layout`` (how a ``torch.layout`` pickles), for layout names only."""
    layout = _LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise UnsafeCheckpointError(f"{name!r} is not a torch layout")
    return layout


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_DATACLASSES = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                MetadataIndex, StorageMeta, _StorageInfo)
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _DATACLASSES}
_NEW_FIELD = re.compile(r"[a-z][a-z0-9_]{0,63}")  # a field a newer torch may add: no dunder, no private name


def _ints(args) -> bool:
    return all(type(a) is int for a in args)


def _check_size(args) -> bool:  # torch.Size((d0, d1, ...))
    return len(args) == 1 and type(args[0]) in (tuple, list) and len(args[0]) <= MAX_DIMS and _ints(args[0])


# What REDUCE may call, each with a check of its arguments (all build plain data, none runs code).
_CALLS: dict[int, tuple[Any, Callable[[tuple], bool]]] = {
    id(f): (f, check) for f, check in (
        (torch.Size, _check_size),
        (_MEM_FORMAT_ENCODING, lambda args: len(args) == 1 and type(args[0]) is int),
        (_layout, lambda args: len(args) == 1 and type(args[0]) is str),
        (OrderedDict, lambda args: args == () or (len(args) == 1 and type(args[0]) is list)),
        (pathlib.PurePosixPath, lambda args: all(type(a) is str for a in args)),
        (pathlib.PureWindowsPath, lambda args: all(type(a) is str for a in args)),
    )
}

# Every global a .metadata may name. Dtypes pickle as plain globals (``torch.float32``), layouts
# through ``torch.serialization._get_layout("torch.strided")`` (replaced by a guarded equivalent),
# a ``StorageMeta.checkpoint_id`` given as a Path as ``pathlib.PosixPath(*parts)`` (built as a pure
# path: no file system access).
_META = "torch.distributed.checkpoint.metadata"
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_META, cls.__name__): cls for cls in _DATACLASSES if cls is not _StorageInfo},
    (_META, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else.

    The pure-Python unpickler, so every opcode that can call or mutate something is ours to guard:

    * globals (GLOBAL, STACK_GLOBAL): only :data:`_GLOBALS` — DCP's metadata dataclasses, its
      ``_StorageInfo`` and ``_MEM_FORMAT_ENCODING``, ``torch.Size``, ``torch.<dtype>``, layouts,
      ``OrderedDict`` and pure paths; anything else (``os.system``, ``builtins.exec``,
      ``builtins.getattr``, ...) raises :class:`UnsafeCheckpointError` naming it;
    * REDUCE: only the callables in :data:`_CALLS`, with their arguments' types checked;
    * NEWOBJ / NEWOBJ_EX: only ``cls.__new__(cls)`` of the metadata dataclasses, no arguments;
    * BUILD: only on an instance of a metadata dataclass (never on a class: no ``setattr`` on
      types), with a dict of its field names (or plain lower-case names a newer torch may add;
      never dunder or private names) put into the instance's own ``__dict__``;
      ``TensorProperties``: its own ``__setstate__`` with the 5-tuple DCP writes;
    * APPEND(S), SETITEM(S), ADDITEMS: only on real lists, dicts and sets (no method lookup on
      other objects);
    * EXT1/2/4 (the copyreg extension registry bypasses ``find_class``), INST, OBJ, PERSID and
      BINPERSID are refused outright: DCP never writes them.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name)) if isinstance(module, str) and isinstance(name, str) else None
        if found is None:
            raise UnsafeCheckpointError(f"refused global {module}.{name}: DCP metadata never needs it "
                                        "(unpickling it could run code from the checkpoint)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("refused a persistent id: DCP metadata has none")

    def _refuse(what: str):
        def refuse(self):
            raise UnsafeCheckpointError(f"refused pickle opcode {what}: DCP metadata never uses it")
        return refuse

    for _op in ("EXT1", "EXT2", "EXT4", "INST", "OBJ", "PERSID", "BINPERSID"):
        dispatch[getattr(pickle, _op)[0]] = _refuse(_op)

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        allowed = _CALLS.get(id(func))
        if allowed is None or allowed[0] is not func:
            raise UnsafeCheckpointError(f"refused call of {_name(func)}: not a constructor DCP metadata uses")
        if type(args) is not tuple or not allowed[1](args):
            raise UnsafeCheckpointError(f"refused call of {_name(func)} with unexpected arguments")
        self.stack[-1] = func(*args)

    def load_newobj(self):
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, {})

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, kwargs)

    @staticmethod
    def _new(cls, args, kwargs):
        if not any(cls is allowed for allowed in _DATACLASSES) or args != () or kwargs != {}:
            raise UnsafeCheckpointError(f"refused creating {_name(cls)}: only DCP's metadata classes, "
                                        "without arguments")
        return cls.__new__(cls)

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if not any(cls is allowed for allowed in _DATACLASSES):
            raise UnsafeCheckpointError(f"refused setting the state of {_name(inst)}")
        if cls is TensorProperties:  # its own __setstate__ takes a 5-tuple and only assigns fields
            if type(state) is not tuple or len(state) != 5 or type(state[3]) is not _MEM_FORMAT_ENCODING:
                raise UnsafeCheckpointError("refused a TensorProperties state of an unexpected shape")
            inst.__setstate__(state)
            return
        if type(state) is not dict or not all(type(k) is str and (k in _FIELDS[cls] or _NEW_FIELD.fullmatch(k))
                                              for k in state):
            raise UnsafeCheckpointError(f"refused a {cls.__name__} state naming attributes that are not fields")
        inst.__dict__.update(state)  # the instance's own dict: never a class, never a dunder name

    def _target(self, kinds: tuple, op: str):
        target = self.stack[-1]
        if type(target) not in kinds:
            raise UnsafeCheckpointError(f"refused {op} on {_name(target)}")
        return target

    def load_append(self):
        value = self.stack.pop()
        self._target((list,), "APPEND").append(value)

    def load_appends(self):
        items = self.pop_mark()
        self._target((list,), "APPENDS").extend(items)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._target((dict, OrderedDict), "SETITEM")[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        target = self._target((dict, OrderedDict), "SETITEMS")
        for i in range(0, len(items) - 1, 2):
            target[items[i]] = items[i + 1]

    def load_additems(self):
        items = self.pop_mark()
        self._target((set,), "ADDITEMS").update(items)

    for _op, _fn in (("REDUCE", load_reduce), ("NEWOBJ", load_newobj), ("NEWOBJ_EX", load_newobj_ex),
                     ("BUILD", load_build), ("APPEND", load_append), ("APPENDS", load_appends),
                     ("SETITEM", load_setitem), ("SETITEMS", load_setitems), ("ADDITEMS", load_additems)):
        dispatch[getattr(pickle, _op)[0]] = _fn
    del _op, _fn, _refuse


def _name(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return f"a {type(obj).__name__}"


def read_dcp_metadata(path: str | os.PathLike | Location, storage_options: dict | None = None) -> Metadata:
    """The ``Metadata`` in ``<path>/.metadata``, unpickled by an allow-list unpickler (no code from
    the file runs) and checked for shape: a refused global or opcode raises
    :class:`UnsafeCheckpointError` naming it; anything malformed :class:`CorruptCheckpointError`."""
    path = locate(path, storage_options)
    if not (path / METADATA_NAME).is_file():
        raise CorruptCheckpointError(f"{path} holds no {METADATA_NAME}: not a DCP checkpoint", path=str(path),
                                     file=METADATA_NAME)
    try:
        raw = path.storage.read_bytes(path.path, METADATA_NAME, MAX_METADATA_BYTES)
    except ValueError:
        raise CorruptCheckpointError(f"{path / METADATA_NAME} is absurdly large", path=str(path),
                                     file=METADATA_NAME) from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        _check_metadata(metadata)
    except CheckpointError as exc:
        exc.path, exc.file = str(path), METADATA_NAME
        exc.args = (f"{path / METADATA_NAME}: {exc.args[0] if exc.args else ''}",)
        raise
    except Exception as exc:  # truncated or malformed pickle, wrong arity, unhashable keys ...
        raise CorruptCheckpointError(f"{path / METADATA_NAME} is not a readable DCP metadata pickle "
                                     f"({type(exc).__name__}: {str(exc)[:200]})", path=str(path),
                                     file=METADATA_NAME) from None
    return metadata


def _bad(message: str) -> InvalidManifestError:
    return InvalidManifestError(message)


def _check_dims(value: Any, what: str) -> None:
    if type(value) is not torch.Size or len(value) > MAX_DIMS or not all(0 <= d < MAX_BYTES for d in value):
        raise _bad(f"{what} is not a size")


def _check_metadata(md: Any) -> None:
    """Every field :func:`import_dcp` uses has the type DCP gives it."""
    if type(md) is not Metadata:
        raise _bad(f"holds a {type(md).__name__}, not DCP's Metadata")
    if type(getattr(md, "state_dict_metadata", None)) is not dict or type(md.storage_data) is not dict:
        raise _bad("state_dict_metadata and storage_data must be dicts")
    if md.version is not None and type(md.version) is not str:
        raise _bad("version must be a string")
    for key, entry in md.state_dict_metadata.items():
        if type(key) is not str:
            raise _bad(f"key {key!r} is not a string")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise _bad(f"{key}: unknown storage metadata {type(entry).__name__}")
        props = getattr(entry, "properties", None)
        if type(props) is not TensorProperties or type(getattr(props, "dtype", None)) is not torch.dtype:
            raise _bad(f"{key}: tensor properties without a dtype")
        _check_dims(getattr(entry, "size", None), f"{key}: size")
        if type(getattr(entry, "chunks", None)) is not list:
            raise _bad(f"{key}: chunks must be a list")
        for chunk in entry.chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise _bad(f"{key}: a chunk is a {type(chunk).__name__}")
            _check_dims(getattr(chunk, "offsets", None), f"{key}: chunk offsets")
            _check_dims(getattr(chunk, "sizes", None), f"{key}: chunk sizes")
    for index, info in md.storage_data.items():
        if type(index) is not MetadataIndex or type(getattr(index, "fqn", None)) is not str:
            raise _bad("a storage_data key is not a MetadataIndex")
        if index.offset is not None:
            _check_dims(index.offset, f"{index.fqn}: storage offset")
        if type(info) is not _StorageInfo or type(getattr(info, "relative_path", None)) is not str or not all(
            type(getattr(info, name, None)) is int and 0 <= getattr(info, name) < MAX_BYTES
            for name in ("offset", "length")
        ):
            raise _bad(f"{index.fqn}: storage info is not a (file, offset, length)")
        descriptors = info.transform_descriptors
        if descriptors is not None and (type(descriptors) not in (list, tuple) or
                                        not all(type(d) is str for d in descriptors)):
            raise _bad(f"{index.fqn}: transform descriptors must be strings")


# -- the import ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Item:
    key: str
    info: _StorageInfo
    offsets: tuple | None = None  # a tensor chunk's box; None for a value
    sizes: tuple | None = None
    dtype: torch.dtype | None = None


def total_tensor_bytes(metadata: Metadata) -> int:
    """Raw bytes of every tensor chunk: what :func:`import_dcp`'s ``progress`` calls add up to."""
    return sum(math.prod(c.sizes) * e.properties.dtype.itemsize for e in metadata.state_dict_metadata.values()
               if isinstance(e, TensorStorageMetadata) for c in e.chunks)


def import_dcp(src: str | os.PathLike | Location, dst: str | os.PathLike | Location, *, overwrite: bool = False,
               progress: Callable[[int], None] | None = None, storage_options: dict | None = None) -> Manifest:
    """Convert the DCP FileSystemWriter checkpoint directory ``src`` into a checkpoint of ours at
    ``dst`` (a step directory such as ``ckpts/step-00000100``; its step is taken from that name).

    Streams chunk by chunk: each tensor chunk is read from its ``.distcp`` file, decoded with
    ``torch.load(weights_only=True)``, checked against the metadata's dtype and box, and stored raw
    with DCP's box; non-tensor values become tagged JSON where possible (else a ``torch.save``
    stream proven to load with ``weights_only=True``); DCP's flatten mapping becomes the manifest's
    ``paths``. Committed atomically (:mod:`ckpt.commit`); ``overwrite`` replaces a committed ``dst``.
    ``progress(n)`` is called with the raw bytes of each tensor chunk once it is decoded.

    Raises :class:`UnsafeCheckpointError` (something would need code execution to load),
    :class:`CorruptCheckpointError` (a truncated or inconsistent checkpoint, a data file path
    leaving ``src``), :class:`UnsupportedFormatError` (a transform or serialization this cannot
    read, a dtype our format cannot store)."""
    src, dst = locate(src, storage_options), locate(dst, storage_options)
    if src.storage is dst.storage and src.storage.identity(src.path) == dst.storage.identity(dst.path):
        raise CheckpointExistsError(f"{dst} is the DCP checkpoint being converted; choose another destination",
                                    path=str(dst))
    metadata = read_dcp_metadata(src)
    items = _plan(src, metadata)
    by_file: dict[str, list[_Item]] = {}
    for item in items:
        by_file.setdefault(item.info.relative_path, []).append(item)
    _check_file_sizes(src, by_file)
    names, world = _output_names(sorted(by_file))
    sizes = {}  # key -> chunk offsets -> chunk sizes
    for item in items:
        if item.offsets is not None:
            sizes.setdefault(item.key, {})[item.offsets] = item.sizes

    manifest = Manifest(
        step=parse_step_name(dst.name), kind="full", world_size=world,
        created=time.time(), dcp_version=metadata.version, user={"converted_from": "dcp"},
        paths=_paths(metadata),
    )
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            try:
                dtype_name(md.properties.dtype)  # refuses dtypes the format cannot store, before any work
            except UnsupportedFormatError as exc:
                raise UnsupportedFormatError(f"{src}: {key}: {exc}", path=str(src), file=METADATA_NAME,
                                             tensor=key) from None
            manifest.tensors[key] = TensorEntry(md.properties.dtype, tuple(md.size), [])
    reader = _Reader(src)
    attempt = commit.begin(dst, overwrite=overwrite)
    try:
        for rel_path in sorted(by_file):
            payloads = []
            for item in sorted(by_file[rel_path], key=lambda i: i.info.offset):
                if item.offsets is None:
                    record = reader.value(item)
                    if isinstance(record, ValueEntry):
                        manifest.values[item.key] = record
                        continue
                    payloads.append(Payload((item.key, None), lambda record=record: record, len(record)))
                else:
                    payloads.append(Payload((item.key, item.offsets),
                                            lambda item=item: reader.chunk(item, progress), 0))
            if not payloads:
                continue
            name = data_file_name(*names[rel_path], attempt.tag)  # tagged on object stores (ckpt.commit)
            for (key, offsets), blob in write_file(attempt.directory, name, payloads):
                record = ValueEntry("torch_save", blob=blob) if offsets is None else \
                    Chunk(offsets, sizes[key][offsets], blob)
                manifest.add_record(key, record)
        manifest.sort_chunks()
        raw = manifest.to_json()
        Manifest.from_json(raw, source=f"{dst} (converted from {src})")  # never publish what we would refuse
        commit.finish(attempt, manifest, overwrite=overwrite, raw=raw)
    except BaseException:
        commit.abort(attempt)
        raise
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


def _plan(src: Location, metadata: Metadata) -> list[_Item]:
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
            _transform(descriptor, src, key)
        if isinstance(md, BytesStorageMetadata):
            items.append(_Item(key, info))
            seen.add((key, None))
            continue
        offsets = tuple(index.offset) if index.offset is not None else None
        if offsets not in boxes[key]:
            raise InvalidManifestError(f"{src}: stored chunk of {key!r} at {offsets} is not one of its chunks",
                                       tensor=key, **where)
        items.append(_Item(key, info, offsets, boxes[key][offsets], md.properties.dtype))
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


def _transform(descriptor: str, src: Location, key: str) -> str:
    """The stream transforms this reads: ``stream.zstd/1`` (DCP's ZStandard extension)."""
    name, _, version = descriptor.partition("/")
    if name == ZSTD and version.partition(".")[0] == "1":
        return ZSTD
    raise UnsupportedFormatError(f"{src}: {key!r} is stored through the stream transform {descriptor!r}, which "
                                 "this cannot read", path=str(src), file=METADATA_NAME, tensor=key)


def _check_file_sizes(src: Location, by_file: dict[str, list[_Item]]) -> None:
    """A data file too short for an item it should hold is refused before any work is done."""
    for rel, items in by_file.items():
        handle = src.storage.open_read(src.path, rel)
        try:
            size = handle.size
        finally:
            handle.close()
        for item in items:
            end = item.info.offset + item.info.length
            if end > size:
                raise CorruptCheckpointError(
                    f"{src}: {rel} is truncated ({size} bytes) - {item.key} needs bytes {item.info.offset}..{end}",
                    path=str(src), file=rel, tensor=item.key)


def _output_names(rel_paths: list[str]) -> tuple[dict[str, tuple[int, int]], int]:
    """The (rank, part) of our data file for each DCP one (``__3_1.distcp`` -> rank 3, part 1:
    ``data/rank-00003-p1.bin``; other names become further parts of rank 0), and the number of
    ranks that wrote."""
    names, used, others = {}, set(), []
    for rel in rel_paths:
        match = _DCP_FILE.fullmatch(rel)
        if match and int(match.group(1)) < (1 << 24):
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


class _Reader:
    """Items of a DCP checkpoint's data files, read, untransformed, decoded and checked."""

    def __init__(self, src: Location):
        self.src = src
        self._open: tuple[str, Any] | None = None  # one data file open at a time (files are done in turn)

    def _stream(self, item: _Item, limit: int) -> bytes:
        """The item's bytes with its transforms undone (at most ``limit`` bytes after them)."""
        rel, info = item.info.relative_path, item.info
        if self._open is None or self._open[0] != rel:
            self.close()
            self._open = (rel, self.src.storage.open_read(self.src.path, rel))
        handle = self._open[1]
        if info.offset + info.length > handle.size:
            raise CorruptCheckpointError(f"{self.src}: {rel} is truncated ({handle.size} bytes) - {item.key} "
                                         f"needs bytes {info.offset}..{info.offset + info.length}",
                                         path=str(self.src), file=rel, tensor=item.key)
        data = bytearray(info.length)
        if handle.read_into(memoryview(data), info.offset) != info.length:
            raise CorruptCheckpointError(f"{self.src}: short read of {item.key} from {rel}", path=str(self.src),
                                         file=rel, tensor=item.key)
        for descriptor in info.transform_descriptors or ():
            _transform(descriptor, self.src, item.key)
            data = self._unzstd(data, limit, item)
        if bytes(data[:4]) != _ZIP_MAGIC:
            raise UnsupportedFormatError(
                f"{self.src}: {item.key} in {rel} is not a torch.save stream (FileSystemWriter's SAFETENSORS "
                "serialization, a custom planner's own bytes, or a damaged file); only DCP's default TORCH_SAVE "
                "serialization is read",
                path=str(self.src), file=rel, tensor=item.key)
        return bytes(data)

    def _unzstd(self, data: bytearray, limit: int, item: _Item) -> bytearray:
        out = bytearray()
        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as stream:
                while len(out) <= limit:
                    piece = stream.read(1 << 20)
                    if not piece:
                        break
                    out += piece
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"{self.src}: {item.key} in {item.info.relative_path} does not "
                                         f"decompress ({exc})", path=str(self.src), file=item.info.relative_path,
                                         tensor=item.key) from None
        if len(out) > limit:
            raise CorruptCheckpointError(f"{self.src}: {item.key} in {item.info.relative_path} decompresses to "
                                         f"more than the {limit} bytes it can hold", path=str(self.src),
                                         file=item.info.relative_path, tensor=item.key)
        return out

    def _load(self, data: bytes, item: _Item) -> Any:
        """``torch.load(weights_only=True)`` of exactly these bytes; never anything weaker."""
        rel = item.info.relative_path
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            reason = str(exc).strip().splitlines()
            raise UnsafeCheckpointError(
                f"{self.src}: {item.key!r} in {rel} cannot be loaded without executing code from the checkpoint "
                f"(torch.load(weights_only=True) refused it: {reason[0][:200] if reason else 'unsafe'}); refused",
                path=str(self.src), file=rel, tensor=item.key) from None
        except Exception as exc:
            raise CorruptCheckpointError(f"{self.src}: {item.key!r} in {rel} is not a readable torch.save stream "
                                         f"({type(exc).__name__}: {str(exc)[:200]})", path=str(self.src), file=rel,
                                         tensor=item.key) from None

    def chunk(self, item: _Item, progress: Callable[[int], None] | None) -> np.ndarray:
        """The chunk's raw bytes, checked against its dtype and box."""
        nbytes = math.prod(item.sizes) * item.dtype.itemsize
        tensor = self._load(self._stream(item, nbytes + STREAM_SLACK), item)
        rel = item.info.relative_path
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided or \
                tensor.is_quantized or tensor.dtype != item.dtype or tuple(tensor.shape) != item.sizes:
            got = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CorruptCheckpointError(f"{self.src}: the chunk of {item.key!r} at {list(item.offsets)} in {rel} "
                                         f"holds {got}; the metadata says {item.dtype} {list(item.sizes)}",
                                         path=str(self.src), file=rel, tensor=item.key)
        if tensor.untyped_storage().nbytes() < nbytes:  # an expanded view: no bigger than what was stored
            raise CorruptCheckpointError(f"{self.src}: the chunk of {item.key!r} in {rel} is a view larger than "
                                         "its stored bytes", path=str(self.src), file=rel, tensor=item.key)
        raw = tensor_bytes(tensor)
        if progress is not None:
            progress(raw.nbytes)
        return raw

    def value(self, item: _Item) -> ValueEntry | bytes:
        """A non-tensor value: a tagged-JSON record, or the bytes of a ``torch.save`` stream of it
        (written by us, proven to load with ``weights_only=True``)."""
        value = self._load(self._stream(item, MAX_VALUE_BYTES), item)
        try:
            return ValueEntry("json", value=values.encode(value))
        except (values.NotJSONable, RecursionError):
            pass
        stream = io.BytesIO()
        torch.save(value, stream)
        data = stream.getvalue()
        self._load(data, item)
        return data

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None
