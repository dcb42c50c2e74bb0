"""The layouts of ``reshard_load.py``: how each rank of its 4 processes holds the state in each one,
which checkpoint each layout loads and which same-layout load it is compared with.

* :class:`Layout`, the source layouts (:data:`SOURCES`, each saved once per system) and the load
  layouts (:data:`LAYOUTS`), each with its ``source`` and ``reference``.
* :class:`Rank`: this process's rank, the 2-rank subgroup and the meshes of 4, 2 and 2×2 ranks.
* :func:`local_shard`, :func:`keys_of`, :func:`sharded_state`: a rank's part of the full state in a
  layout (DTensors, or plain tensors for a pipeline stage or one process); :func:`verify` checks it
  bitwise after a load.
* :func:`chosen` (the layouts asked for plus their references) and :func:`units` (what one repeat
  times per system: each resharded layout next to its reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

WORLD = 4


@dataclass(frozen=True)
class Layout:
    """How a rank holds the state: ``kind`` "shard" (DTensors, ``Shard(dim)`` over ``ranks``),
    "fsdp_tp" (a 2×2 mesh: ``Shard(0)`` over dp, ``Shard(1)`` over tp), "pp" (whole tensors, the
    keys split over the ranks) or "plain" (one process, whole tensors)."""

    name: str
    ranks: int
    dim: int = 0
    kind: str = "shard"
    source: str = "2 ranks Shard(0) (same)"  # the checkpoint it loads (the name of the layout that saved it)
    reference: str = "2 ranks Shard(0) (same)"  # the same-layout load it is compared with


SAVED = Layout("2 ranks Shard(0) (same)", 2, 0)
QUAD = Layout("4 ranks Shard(0) (same)", 4, 0, source="4 ranks Shard(0) (same)", reference="4 ranks Shard(0) (same)")
FSDP_TP = Layout("4 ranks FSDP×TP (saved)", 4, kind="fsdp_tp")
SINGLE = Layout("1 rank (same)", 1, kind="plain", source="1 rank (same)", reference="1 rank (same)")
PIPELINE = Layout("2 ranks PP (saved)", 2, kind="pp")
SOURCES = (SAVED, QUAD, FSDP_TP, SINGLE, PIPELINE)  # saved once per system, each in its own directory
LAYOUTS = (SAVED, QUAD, Layout("2 → 4 ranks Shard(0)", 4, 0, reference=QUAD.name), Layout("2 ranks Shard(1)", 2, 1),
           Layout("FSDP×TP 4 → FSDP 2", 2, 0, source=FSDP_TP.name), SINGLE,
           Layout("PP 2 → 1", 1, kind="plain", source=PIPELINE.name, reference=SINGLE.name))


SOURCE_DIRS = {layout.name: f"source-{i}" for i, layout in enumerate(SOURCES)}


def source_dir(work: Path, system: str, layout: Layout) -> Path:
    """Where ``system`` saved the checkpoint that ``layout`` loads."""
    return work / system / SOURCE_DIRS[layout.source]


class Rank:
    """This process's view: its rank, the meshes and groups of both world sizes."""

    def __init__(self, rank: int):
        self.rank = rank
        self.pair = dist.new_group([0, 1])  # collective: every rank creates it
        self.meshes = {4: DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                       2: DeviceMesh.from_group(self.pair, "cpu") if rank < 2 else None,
                       (2, 2): DeviceMesh("cpu", torch.arange(WORLD).reshape(2, 2), mesh_dim_names=("dp", "tp"))}

    def group(self, layout: Layout):
        return None if layout.ranks == WORLD else self.pair

    def member(self, layout: Layout) -> bool:
        return self.rank < layout.ranks


def local_shard(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """The part of ``full`` that ``rank`` holds in ``layout`` (a view; even chunks)."""
    if layout.kind == "fsdp_tp":
        return full.chunk(2, dim=0)[rank // 2].chunk(2, dim=1)[rank % 2]
    if layout.kind in ("pp", "plain"):
        return full
    return full.chunk(layout.ranks, dim=layout.dim)[rank]


def keys_of(full: dict, layout: Layout, rank: int) -> list[str]:
    """The keys ``rank`` holds: a pipeline stage holds its own half of the layers."""
    keys = sorted(full)
    return keys[rank::layout.ranks] if layout.kind == "pp" else keys


def sharded_state(full: dict, layout: Layout, me: Rank, fill: bool) -> dict:
    """This rank's state in ``layout`` (DTensors, or plain tensors for "pp"/"plain"): copies of its
    shards (``fill``) or zeros."""
    state = {}
    for key in keys_of(full, layout, me.rank):
        t = full[key]
        shard = local_shard(t, layout, me.rank)
        local = shard.clone(memory_format=torch.contiguous_format) if fill else torch.zeros(shard.shape)
        if layout.kind in ("pp", "plain"):
            state[key] = local
        elif layout.kind == "fsdp_tp":
            state[key] = DTensor.from_local(local, me.meshes[(2, 2)], [Shard(0), Shard(1)], run_check=False,
                                            shape=t.shape, stride=t.stride())
        else:
            state[key] = DTensor.from_local(local, me.meshes[layout.ranks], [Shard(layout.dim)], run_check=False,
                                            shape=t.shape, stride=t.stride())
    return state


def verify(state: dict, full: dict, layout: Layout, rank: int, what: str) -> None:
    for key in keys_of(full, layout, rank):
        value = state[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        if not torch.equal(local, local_shard(full[key], layout, rank)):
            raise RuntimeError(f"{what}: {key} differs on rank {rank} after load")


def chosen(only: tuple[str, ...] | None) -> tuple[Layout, ...]:
    """The layouts named in ``only`` (all when None) with the references they are compared with."""
    if not only:
        return LAYOUTS
    wanted = {layout.name for layout in LAYOUTS if layout.name in only}
    wanted |= {layout.reference for layout in LAYOUTS if layout.name in wanted}
    return tuple(layout for layout in LAYOUTS if layout.name in wanted)


def units(layouts: tuple[Layout, ...]) -> list[tuple[Layout, ...]]:
    """What one repeat times, per system: each resharded layout next to a load of its reference
    layout (``(reference, resharded)``: a reference two layouts use is loaded once for each), and
    alone each reference no chosen resharded layout uses."""
    by_name = {layout.name: layout for layout in layouts}
    pairs = [(by_name[layout.reference], layout) for layout in layouts if layout.reference != layout.name]
    paired = {reference.name for reference, _ in pairs}
    return pairs + [(layout,) for layout in layouts if layout.reference == layout.name and layout.name not in paired]
