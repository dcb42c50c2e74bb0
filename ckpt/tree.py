"""The one walker of nested state: dicts (any Mapping), lists and tuples around leaves.

    leaves(tree)            every leaf, depth first, in insertion order
    transform(tree, visit)  a rebuilt tree: ``visit(node, path)`` returns the node's replacement,
                            or DESCEND to rebuild a container from its transformed children

Containers are rebuilt as plain dicts, lists and tuples; ``path`` is the tuple of keys and list
indices from the root. Everything that walks user state (export and restore in :mod:`ckpt.state`,
snapshots in :mod:`ckpt.write.staging`) goes through these two functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

CONTAINERS = (Mapping, list, tuple)
DESCEND = object()  # returned by a visitor: walk into this container


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
