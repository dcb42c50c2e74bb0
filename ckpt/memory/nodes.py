"""Which node a rank is on, which rank holds its partner copy, and who can read whose files.

Ranks are numbered node by node (node = rank // local_world, as torchrun does). Node ``n``'s partner
is node ``(n + max(1, nnodes // 2)) % nnodes`` (the opposite half, or a shift: one to one); a rank's
partner (:func:`partner_rank`) is the same local rank there, its source (:func:`source_rank`) the rank
whose partner it is; one node: none.
"""

from __future__ import annotations

from ..errors import InvalidOptionError


def node_of(rank: int, local_world: int) -> int:
    """The node of ``rank`` (ranks numbered node by node)."""
    return rank // local_world


def _shifted(rank: int, world: int, local_world: int, sign: int) -> int | None:
    if local_world < 1 or world % local_world or not 0 <= rank < world:
        raise InvalidOptionError("local_world", local_world, f"ranks per node must divide the world size "
                                 f"{world} (rank {rank})")
    nnodes = world // local_world
    if nnodes == 1:
        return None
    node = (node_of(rank, local_world) + sign * max(1, nnodes // 2)) % nnodes
    return node * local_world + rank % local_world


def partner_rank(rank: int, world: int, local_world: int) -> int | None:
    """The rank that holds ``rank``'s copy: the same local rank on the partner node (None: one node)."""
    return _shifted(rank, world, local_world, +1)


def source_rank(rank: int, world: int, local_world: int) -> int | None:
    """The rank whose copy ``rank`` holds (``partner_rank``'s inverse; None: one node)."""
    return _shifted(rank, world, local_world, -1)


def readers_by_step(listings: list[dict[int, list[int]]], world: int, local_world: int) -> dict[int, dict[int, list[int]]]:
    """From each rank's listing of its node's complete steps (``listings[rank]``: step -> the ranks
    whose files the node holds): step -> {rank r: the ranks that can read r's files there, one per
    node holding them — r itself first when its own node does, then for each node holding its copy
    that node's rank of r's local rank (so a node's copies are sent by as many of its ranks, at
    once)}. A complete step every rank's files of which are gone is still named."""
    holders: dict[int, dict[int, list[int]]] = {}
    for reader, steps in enumerate(listings):
        node = node_of(reader, local_world)
        for step, ranks in steps.items():
            found = holders.setdefault(step, {})
            for r in ranks:
                readers = found.setdefault(r, [])
                if all(node_of(other, local_world) != node for other in readers):
                    readers.append(r if node == node_of(r, local_world) else _peer(r, node, reader, world, local_world))
    for found in holders.values():
        for r, readers in found.items():
            readers.sort(key=lambda reader, r=r: (reader != r, reader))  # its own node first
    return holders


def _peer(r: int, node: int, reader: int, world: int, local_world: int) -> int:
    """The rank of ``node`` with ``r``'s local rank (``reader``, a rank of that node, where the last
    node has fewer ranks)."""
    peer = node * local_world + r % local_world
    return peer if peer < world else reader
