"""A framework's checkpoint dict stored in our format, and read back without a template.

Frameworks hand a plug-in one nested dict (Lightning's checkpoint, a DeepSpeed rank's state) and
expect the same dict back from a path, with no live object to load into. :func:`encode_tree` turns
it into a flat state the engine stores as it is:

- every tensor (DTensor included) under its own key, the path joined with ``.``
  (``state_dict.layer.weight``, ``optimizer_states.0.state.0.exp_avg``), stored as tensor chunks;
- every other leaf that JSON cannot hold as it is (bytes, NaN, NumPy arrays, dtypes, ...) under its
  key too, stored by the engine's value encoding (tagged JSON, or a ``torch.save`` stream read back
  with ``weights_only=True`` only; anything else is refused at save time);
- the tree's shape in one JSON value, :data:`STRUCTURE`: dicts with their keys as they were (int
  keys stay ints, order kept), lists, tuples, ``torch.Size``, plain scalars inline, and a
  reference where a stored leaf goes. Objects of an allow-listed class (``objects=``) are kept as
  their attributes and rebuilt from them, never unpickled.

:func:`read_tree` reads a checkpoint back into a nested dict: the template comes from its manifest
(shapes, dtypes, keys), every byte is verified, nothing is unpickled. A checkpoint without
:data:`STRUCTURE` (one a :class:`~ckpt.CheckpointManager` wrote, say) comes back nested along the
keys' DCP paths, with state dicts of modules and optimizers as the engine stored them.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import torch

from .. import load as load_checkpoint
from .. import Manifest, read_manifest

STRUCTURE = "__ckpt_structure__"

# An allow-listed class: (name recorded in the checkpoint, class). Its attributes are stored as a
# tree; it is rebuilt with ``cls.__new__(cls)`` and those attributes, without running its __init__.
ObjectTypes = dict[str, type]


def encode_tree(tree: dict, objects: ObjectTypes | None = None) -> dict:
    """The flat state that stores ``tree``: stored leaves by key, plus :data:`STRUCTURE`."""
    names = {type_: name for name, type_ in (objects or {}).items()}
    flat: dict[str, Any] = {}

    def key_for(path: tuple) -> str:
        key = ".".join(map(str, path)) or "_"
        base, n = key, 1
        while key in flat or key == STRUCTURE:
            key, n = f"{base}#{n}", n + 1
        return key

    def visit(node: Any, path: tuple) -> Any:
        if isinstance(node, torch.Tensor):
            key = key_for(path)
            flat[key] = node
            return {"ref": key}
        if isinstance(node, torch.Size):
            return {"size": list(node)}
        if isinstance(node, dict):
            return {"d": [[_json_key(k, path), visit(v, path + (k,))] for k, v in node.items()]}
        if isinstance(node, list):
            return [visit(v, path + (i,)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return {"t": [visit(v, path + (i,)) for i, v in enumerate(node)]}
        if type(node) in names:
            return {"obj": names[type(node)], "state": visit(dict(vars(node)), path)}
        plain = _plain(node)
        if plain is not None or node is None:
            return plain
        key = key_for(path)
        flat[key] = node
        return {"ref": key}

    flat[STRUCTURE] = json.dumps(visit(tree, ()), allow_nan=False)
    return flat


def _plain(value: Any) -> Any:
    """``value`` as a JSON scalar (an int or str subclass such as an IntEnum as the plain type), or None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return float(value)
    return None


def _json_key(key: Any, path: tuple) -> Any:
    if key is None or _plain(key) is not None:
        return _plain(key)
    raise TypeError(f"checkpoint key {key!r} under {'.'.join(map(str, path)) or 'the top'} is not a "
                    "str, int, float, bool or None")


def decode_tree(flat: dict, objects: ObjectTypes | None = None) -> dict:
    """The tree :func:`encode_tree` stored, from the loaded flat state."""
    objects = objects or {}

    def build(node: Any) -> Any:
        if isinstance(node, list):
            return [build(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "ref" in node:
            return flat[node["ref"]]
        if "size" in node:
            return torch.Size(node["size"])
        if "t" in node:
            return tuple(build(v) for v in node["t"])
        if "obj" in node:
            cls = objects.get(node["obj"])
            if cls is None:
                raise TypeError(f"the checkpoint holds an object of class {node['obj']!r}, which is not allow-listed")
            obj = cls.__new__(cls)
            obj.__dict__.update(build(node["state"]))
            return obj
        return {k: build(v) for k, v in node["d"]}

    return build(json.loads(flat[STRUCTURE]))


def read_tree(path: str | os.PathLike, *, objects: ObjectTypes | None = None, mirrors: tuple = (),
              storage_options: dict | None = None,
              map_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """Read the whole checkpoint at ``path`` (this process alone) into a new nested dict."""
    manifest = read_manifest(path, storage_options)
    template = manifest_template(manifest)
    load_checkpoint(template, path, no_dist=True, mirrors=mirrors, storage_options=storage_options,
                    rollback=False)  # fresh tensors of its own: nothing of the caller's to put back
    if map_tensor is not None:
        template = _map_tensors(template, map_tensor)
    if STRUCTURE in manifest.values:
        return decode_tree(template, objects)
    return template


def manifest_template(manifest: Manifest, under: str | None = None) -> dict:
    """A nested state to load ``manifest``'s checkpoint into: a new tensor of each stored shape and
    dtype, None for each value (along the keys' DCP paths). ``under``: only that top-level key."""
    template: dict[str, Any] = {}
    for key, entry in manifest.tensors.items():
        path = manifest.paths.get(key, (key,))
        if under is None or path[0] == under:
            _put(template, path, torch.empty(entry.shape, dtype=entry.dtype))
    for key in manifest.values:
        path = manifest.paths.get(key, (key,))
        if under is None or path[0] == under:
            _put(template, path, None)
    return template


def _put(tree: dict, path: tuple, value: Any) -> None:
    """Place ``value`` at ``path`` (str parts: dict keys, int parts: list positions) in ``tree``."""
    node: Any = tree
    for part, following in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            node[part] = empty if node[part] is None else node[part]
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _map_tensors(node: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        return fn(node)
    if isinstance(node, dict):
        return {k: _map_tensors(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_tensors(v, fn) for v in node]
    return node
