"""Which node a rank is on, and which rank holds its partner copy.

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
