"""DCP's ``.metadata``, read without running code from it: an allow-list unpickler and a shape check.

``torch.distributed.checkpoint``'s ``FileSystemWriter`` (torch 2.13) writes ``<dir>/.metadata`` as
``pickle.dump`` of a ``Metadata``: ``state_dict_metadata`` (key -> TensorStorageMetadata(dtype,
global size, chunk boxes) or BytesStorageMetadata), ``planner_data`` (key -> path in the nested
state: DCP's flatten mapping), ``storage_data`` (MetadataIndex(key, chunk offsets) ->
_StorageInfo(relative_path, offset, length, transform_descriptors)), ``storage_meta``, ``version``.

DCP itself reads it with ``pickle.load``, which executes code from a hostile checkpoint (pytorch
#189308). :func:`read_dcp_metadata` reads it with :class:`_MetadataUnpickler` (see it for exactly
what it admits): what it refuses raises :class:`~ckpt.errors.UnsafeCheckpointError` naming it; then
every field :mod:`ckpt.convert.dcp.importer` uses is checked to have the type DCP gives it
(:class:`~ckpt.errors.CorruptCheckpointError` otherwise). Bounded: the file's ends are checked
before it is read, dict keys must be plain (no hashing of shared tuples), and the result is walked
within an element budget its size allows (:mod:`ckpt.convert.dcp.bounds`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pathlib
import pickle
import re
from collections import OrderedDict
from typing import Any, Callable

import torch
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

from ...read.committed import DCP_METADATA_NAME as METADATA_NAME, read_metadata_file
from ...errors import CheckpointError, CorruptCheckpointError, InvalidManifestError, UnsafeCheckpointError
from ...format import MAX_BYTES, MAX_DIMS
from ...storage import Location, locate
from .bounds import check_pickle_ends, check_structure, element_budget

MAX_METADATA_BYTES = 1 << 32
MAX_METADATA_DEPTH = 32  # Metadata > dict > TensorStorageMetadata > chunks > chunk > Size > int: 6


# -- the allow-list unpickler ----------------------------------------------------------------------
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
        self._target((dict, OrderedDict), "SETITEM")[_key(key)] = value

    def load_setitems(self):
        items = self.pop_mark()
        target = self._target((dict, OrderedDict), "SETITEMS")
        for i in range(0, len(items) - 1, 2):
            target[_key(items[i])] = items[i + 1]

    def load_additems(self):
        items = self.pop_mark()
        self._target((set,), "ADDITEMS").update(_key(item) for item in items)

    for _op, _fn in (("REDUCE", load_reduce), ("NEWOBJ", load_newobj), ("NEWOBJ_EX", load_newobj_ex),
                     ("BUILD", load_build), ("APPEND", load_append), ("APPENDS", load_appends),
                     ("SETITEM", load_setitem), ("SETITEMS", load_setitems), ("ADDITEMS", load_additems)):
        dispatch[getattr(pickle, _op)[0]] = _fn
    del _op, _fn, _refuse


_KEY_LEAVES = (str, int, type(None))


def _key(key: Any) -> Any:
    """A dict key or set item as DCP writes them (a string, an int, a MetadataIndex of plain fields):
    anything else could be a memo-shared tuple whose hash walks 2^40 leaves."""
    if type(key) in _KEY_LEAVES or (type(key) is MetadataIndex and type(getattr(key, "fqn", None)) is str and
                                    type(getattr(key, "offset", None)) in (torch.Size, type(None)) and
                                    type(getattr(key, "index", None)) in (int, type(None))):
        return key
    raise UnsafeCheckpointError(f"refused a dict key of type {type(key).__name__}: DCP metadata never uses it")


def _name(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return f"a {type(obj).__name__}"


# -- reading and checking -------------------------------------------------------------------------
def read_dcp_metadata(path: str | os.PathLike | Location, storage_options: dict | None = None) -> Metadata:
    """The ``Metadata`` in ``<path>/.metadata``, unpickled by an allow-list unpickler (no code from
    the file runs) and checked for shape: a refused global or opcode raises
    :class:`UnsafeCheckpointError` naming it; anything malformed :class:`CorruptCheckpointError`. A
    :class:`~ckpt.storage.Location` is used as it is (resolved by the caller)."""
    path = locate(path, storage_options)
    if not (path / METADATA_NAME).is_file():
        raise CorruptCheckpointError(f"{path} holds no {METADATA_NAME}: not a DCP checkpoint", path=str(path),
                                     file=METADATA_NAME)
    check_pickle_ends(path, METADATA_NAME, MAX_METADATA_BYTES)
    raw = read_metadata_file(path, METADATA_NAME, MAX_METADATA_BYTES, CorruptCheckpointError)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        check_structure(metadata, budget=element_budget(len(raw)), max_depth=MAX_METADATA_DEPTH, what="it",
                        error=InvalidManifestError)
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
    """Every field :func:`~ckpt.convert.dcp.importer.import_dcp` uses has the type DCP gives it."""
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


def total_tensor_bytes(metadata: Metadata) -> int:
    """Raw bytes of every tensor chunk: what :func:`ckpt.convert.dcp.importer.import_dcp`'s
    ``progress`` calls add up to."""
    return sum(math.prod(c.sizes) * e.properties.dtype.itemsize for e in metadata.state_dict_metadata.values()
               if isinstance(e, TensorStorageMetadata) for c in e.chunks)
