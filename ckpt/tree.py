"""The one walker of nested state: dicts (any Mapping), lists and tuples around leaves.

    leaves(tree)            every leaf, depth first, in insertion order
    transform(tree, visit)  a rebuilt tree: ``visit(node, path)`` returns the node's replacement,
                            or DESCEND to rebuild a container from its transformed children
    copy_tree(tree, leaf)   a rebuilt tree, every leaf replaced by ``leaf(value)`` (no paths); where
                            that is HOLE, the place is kept: ``.fill(values)`` puts values there later

Containers are rebuilt as plain dicts, lists and tuples; ``path`` is the tuple of keys and list
indices from the root. Everything that walks user state (export and restore in :mod:`ckpt.state`,
snapshots in :mod:`ckpt.write.staging`) goes through these functions.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

CONTAINERS = (Mapping, list, tuple)
DESCEND = object()  # returned by a visitor: walk into this container
HOLE = object()  # returned by copy_tree's leaf function: a place filled later


def leaves(node: Any, into: tuple[type, ...] = CONTAINERS) -> Iterator[Any]:
    """Every non-container value below ``node`` (containers are the types in ``into``)."""
    if isinstance(node, into):
        for child in node.values() if isinstance(node, Mapping) else node:
            yield from leaves(child, into)
    else:
        yield node


def transform(node: Any, visit: Callable[[Any, tuple], Any], path: tuple = ()) -> Any:
    """Rebuild ``node``: each node becomes ``visit(node, path)``, or, where that is DESCEND, a new
    container of its transformed children (a non-container told to descend stays as it is)."""
    replacement = visit(node, path)
    if replacement is not DESCEND:
        return replacement
    if isinstance(node, Mapping):
        return {key: transform(value, visit, path + (key,)) for key, value in node.items()}
    if isinstance(node, list):
        return [transform(value, visit, path + (i,)) for i, value in enumerate(node)]
    if isinstance(node, tuple):
        return tuple(transform(value, visit, path + (i,)) for i, value in enumerate(node))
    return node


def descend_containers(leaf: Callable[[Any], Any]) -> Callable[[Any, tuple], Any]:
    """A visitor that walks every container and replaces each leaf by ``leaf(value)``."""
    return lambda node, path: DESCEND if isinstance(node, CONTAINERS) else leaf(node)


class Skeleton:
    """A tree from :func:`copy_tree` whose holes are filled once their values exist."""

    def __init__(self, box: list, holes: list[tuple[Any, Any]], tuples: list[tuple[Any, Any]]):
        self._box, self._holes, self._tuples = box, holes, tuples

    def fill(self, values: Iterable[Any]) -> Any:
        """The tree, each hole (depth first) given the next of ``values``, one per hole (ValueError
        otherwise). Once: the tree is then complete."""
        for (container, key), value in zip(self._holes, values, strict=True):
            container[key] = value
        for container, key in self._tuples:  # the innermost first: a tuple holding a hole was a list
            container[key] = tuple(container[key])
        return self._box[0]


class _OpenTuple(list):
    """A tuple with a hole below it, a list until its holes are filled."""


def copy_tree(node: Any, leaf: Callable[[Any], Any]) -> Skeleton:
    """``node`` rebuilt as :func:`transform` rebuilds it with a visitor that walks every container and
    replaces each leaf by ``leaf(value)``; a leaf replaced by HOLE is a place filled later
    (:meth:`Skeleton.fill`), in the order the leaves were met (depth first)."""
    global _kinds_token
    if abc.get_cache_token() != _kinds_token:  # a class was registered as a Mapping since: learn again
        _KINDS.clear()
        _kinds_token = abc.get_cache_token()
    holes: list[tuple[Any, Any]] = []
    tuples: list[tuple[Any, Any]] = []
    box = [_copy(node, leaf, holes, tuples)]
    if box[0] is HOLE or type(box[0]) is _OpenTuple:
        _note(box, 0, box[0], holes, tuples)
    return Skeleton(box, holes, tuples)


_MAPPING, _LIST, _TUPLE, _LEAF = range(4)
_KINDS: dict[type, int] = {dict: _MAPPING, list: _LIST, tuple: _TUPLE}  # type -> what copy_tree makes of it
_kinds_token = abc.get_cache_token()


def _kind(node: Any) -> int:
    kind = _KINDS.get(type(node))
    if kind is None:
        kind = _KINDS[type(node)] = (_MAPPING if isinstance(node, Mapping) else _LIST if isinstance(node, list)
                                     else _TUPLE if isinstance(node, tuple) else _LEAF)
    return kind


def _copy(node: Any, leaf: Callable[[Any], Any], holes: list, tuples: list) -> Any:
    kind = _kind(node)
    if kind == _LEAF:
        return leaf(node)
    if kind == _MAPPING:
        out: Any = {}
        for key, value in node.items():
            out[key] = child = _copy(value, leaf, holes, tuples)
            if child is HOLE or type(child) is _OpenTuple:
                _note(out, key, child, holes, tuples)
        return out
    before = len(holes) + len(tuples)
    out = [] if kind == _LIST else _OpenTuple()  # the object its holes are noted in
    for i, value in enumerate(node):
        out.append(child := _copy(value, leaf, holes, tuples))
        if child is HOLE or type(child) is _OpenTuple:
            _note(out, i, child, holes, tuples)
    if kind == _LIST or len(holes) + len(tuples) > before:
        return out
    return tuple(out)


def _note(container: Any, key: Any, child: Any, holes: list, tuples: list) -> None:
    if child is HOLE:
        holes.append((container, key))
    elif type(child) is _OpenTuple:
        tuples.append((container, key))
