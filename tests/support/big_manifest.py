"""Synthetic manifests of thousands of ranks, and one rank's live state against them, built without
processes: what the planning-scale test and benchmarks/bench_planning.py plan a load against.

    manifest = sharded_manifest(world=8192, layout="rows")    # every tensor Shard(0) over the ranks
    state = rank_state(manifest, rank=5, world=8192, layout="rows")

Layouts: ``rows`` (FSDP: each tensor's rows split over the ranks), ``columns`` (a tall matrix's
columns split over the ranks: TP column shards, where every saved chunk starts at row 0). A rank's
live tensors are zero-stride views of the global shape (no memory) that describe their own shard the way a DTensor
does (``__create_chunk_list__``), so DCP's planners and ours plan exactly as on that rank.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ckpt.format import Blob, Chunk, Manifest, TensorEntry, data_file_name

ROWS_PER_RANK = 4
WIDTH = 64


def _shape(layout: str, world: int) -> tuple[int, int]:
    return (world * ROWS_PER_RANK, WIDTH) if layout == "rows" else (2 * world, world)


def _box(layout: str, shape: tuple[int, int], world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    rows, cols = shape
    if layout == "rows":
        per = rows // world
        return (rank * per, 0), (per, cols)
    per = cols // world
    return (0, rank * per), (rows, per)


def sharded_manifest(world: int, layout: str = "rows", tensors: int = 8) -> Manifest:
    """``tensors`` float32 tensors, each saved by every rank as one chunk in ``layout``."""
    manifest = Manifest(world_size=world, step=1, dcp_version="1.0.0")
    for t in range(tensors):
        chunks = []
        for rank in range(world):
            offsets, sizes = _box(layout, _shape(layout, world), world, rank)
            nbytes = sizes[0] * sizes[1] * 4
            chunks.append(Chunk(offsets, sizes, Blob(data_file_name(rank), t * nbytes, nbytes, f"{rank:016x}")))
        manifest.tensors[f"layers.{t}.weight"] = TensorEntry(torch.float32, _shape(layout, world), chunks)
        manifest.paths[f"layers.{t}.weight"] = ("layers", str(t), "weight")
    for rank in range(world):
        manifest.files[data_file_name(rank)] = tensors * ROWS_PER_RANK * WIDTH * 4
    return manifest


class RankShard(torch.Tensor):
    """A zero-stride tensor of the global shape standing for one rank's shard (DTensor's checkpoint hook)."""

    box: tuple = ((), ())

    def __create_chunk_list__(self):
        offsets, sizes = self.box
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]


def rank_state(manifest: Manifest, rank: int, world: int, layout: str = "rows") -> dict:
    """Rank ``rank`` of ``world``'s live state for ``manifest``, its tensors split in ``layout`` (flat
    keys, as DCP sees them); another world or layout than the manifest's is a resharded load."""
    state = {}
    for key, entry in manifest.tensors.items():
        shard = torch.zeros((), dtype=entry.dtype).expand(entry.shape).as_subclass(RankShard)  # no memory
        shard.box = _box(layout, entry.shape, world, rank)
        state[key] = shard
    return state
