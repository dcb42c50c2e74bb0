"""Replicated bytes read once: a stored chunk several ranks need whole is read from storage by one
of them and sent to the others (ckpt.read.assignment decides, ckpt.read.exchange moves and verifies).

Counted at the storage layer (tests/support/read_counting.py): a 4-rank DDP-style load and an HSDP
(2 replicate x 2 shard) load read one copy of the checkpoint's bytes in total, not one per replica,
and load bitwise what was saved; a corrupt shared chunk fails every rank (no rank hangs).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import ckpt
from ckpt.read.assignment import RankShares, assign_shared_reads
from ckpt.format import Blob, Chunk
from tests.support.launch import run_ranks
from tests.support.read_counting import counting_reads


def _item(fqn, offsets, storage_offsets, lengths):
    return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, offsets), torch.Size([0] * len(offsets)),
                    MetadataIndex(fqn, offsets), torch.Size(storage_offsets), torch.Size(lengths))


def _chunk(offsets, sizes, length):
    return Chunk(tuple(offsets), tuple(sizes), Blob("data/rank-00000.bin", 0, length, "0" * 16))


def test_assignment_spreads_readers_and_leaves_partial_reads_alone():
    mib = 1 << 20
    storage = {MetadataIndex(f"w{i}", (0,)): _chunk((0,), (mib,), 4 * mib) for i in range(8)}
    storage[MetadataIndex("big", (0,))] = _chunk((0,), (2 * mib,), 8 * mib)
    plans = [LoadPlan([_item(index.fqn, (0,), (0,), storage[index].sizes) for index in storage]) for _ in range(4)]
    plans[3] = LoadPlan([_item("big", (0,), (mib,), (mib,))])  # rank 3 needs half of "big": reads it itself
    out = assign_shared_reads(plans, storage)
    assert all(isinstance(p.storage_data, RankShares) for p in out[:3]) and out[3].storage_data is None
    ops = out[0].storage_data.ops
    assert [op.op for op in ops] == list(range(9)) and ops[0].indices[0].fqn == "big"  # largest first
    assert all(len(op.indices) == 1 for op in ops)  # large chunks travel one by one
    readers = {op.reader for op in ops}
    assert readers == {0, 1, 2}  # spread over the takers, not all on rank 0
    for rank in range(3):
        assert out[rank].storage_data.ops == ops  # the same exchanges, in the same order, on every taker
    assert all(3 not in (op.reader, *op.receivers) for op in ops)


def test_small_shared_chunks_travel_in_batches_per_set_of_takers():
    storage = {MetadataIndex(f"step{i}", ()): _chunk((), (), 4) for i in range(40)}  # optimizer step counters
    storage |= {MetadataIndex(f"norm{i}", (0,)): _chunk((0,), (1 << 17,), 1 << 19) for i in range(40)}  # 512 KiB
    storage[MetadataIndex("pair", ())] = _chunk((), (), 4)
    plans = [LoadPlan([_item(index.fqn, index.offset, (0,) * len(storage[index].sizes), storage[index].sizes)
                       for index in storage if index.fqn != "pair"]) for _ in range(4)]
    for rank in (0, 1):
        plans[rank].items.append(_item("pair", (), (), ()))
    ops = {op.op: op for plan in assign_shared_reads(plans, storage) for op in plan.storage_data.ops}
    batches = [op for op in ops.values() if set(op.receivers) | {op.reader} == {0, 1, 2, 3}]
    # 40 × 512 KiB = 20 MiB: two batches of at most 16 MiB, then the counters fill the second
    assert [len(op.indices) for op in batches] == [32, 48]
    assert sum(storage[i].blob.length for i in batches[0].indices) <= 16 << 20
    assert {i.fqn for op in batches for i in op.indices} == {i.fqn for i in storage if i.fqn != "pair"}
    (pair,) = [op for op in ops.values() if op not in batches]
    assert pair.indices == (MetadataIndex("pair", ()),) and {pair.reader, *pair.receivers} == {0, 1}


def test_nothing_shared_when_each_chunk_has_one_taker():
    storage = {MetadataIndex("w", (r * 4,)): _chunk((r * 4,), (4,), 16) for r in range(4)}
    plans = [LoadPlan([_item("w", (r * 4,), (0,), (4,))]) for r in range(4)]
    assert assign_shared_reads(plans, storage) == plans


def test_files_several_ranks_read_in_part_are_read_together_when_a_rank_has_two():
    def chunk(file, rows):
        return Chunk((rows, 0), (4, 8), Blob(f"data/rank-0000{file}.bin", 0, 128, "0" * 16))

    storage = {MetadataIndex("w", (rows, 0)): chunk(rows // 4, rows) for rows in (0, 4)}
    shard1 = [LoadPlan([_item("w", (rows, 0), (0, col), (4, 4)) for rows in (0, 4)]) for col in (0, 4)]
    out = assign_shared_reads(shard1, storage)  # Shard(0) -> Shard(1): both ranks need both files
    assert [plan.storage_data.together for plan in out] == [{"data/rank-00000.bin", "data/rank-00001.bin"}] * 2
    assert all(plan.storage_data.ops == [] for plan in out)
    halves = [LoadPlan([_item("w", (0, 0), (2 * half, 0), (2, 8))]) for half in (0, 1)]
    assert assign_shared_reads(halves, storage) == halves  # one file each: nothing to read side by side
    alone = [LoadPlan([_item("w", (rows, 0), (0, 0), (4, 8)) for rows in (0, 4)]), LoadPlan([])]
    assert assign_shared_reads(alone, storage) == alone  # one rank reads both files, no other rank does


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # w and v travel alone (1 MiB or more), the small ones in one batch (ckpt.read.assignment.SMALL_BYTES)
    return {"w": torch.randn(512, 1024, generator=g), "v": torch.randn(384, 1024, generator=g),
            "b": torch.randn(32, generator=g),
            "e": torch.randint(0, 100, (17, 5), generator=g), "h": torch.randn(8, 8, generator=g).bfloat16(),
            "step": 3}


def _ddp(rank: int, world: int, path: str, corrupt: str | None):
    ckpt.save(_state(0), path)  # replicated: DCP stores each tensor once
    manifest = ckpt.load(_state(1), path)  # warm-up load: the manifest read, nothing counted yet
    if corrupt:
        torch.distributed.barrier()
        if rank == 0:
            chunk = manifest.tensors[corrupt].chunks[0]
            with open(f"{path}/{chunk.blob.file}", "r+b") as f:
                f.seek(chunk.blob.offset + 5)
                byte = f.read(1)
                f.seek(chunk.blob.offset + 5)
                f.write(bytes([byte[0] ^ 0xFF]))
        torch.distributed.barrier()
        try:
            ckpt.load(_state(1), path)
        except ckpt.CorruptCheckpointError as exc:
            return "corrupt", str(exc)
        return "loaded", None
    state = _state(1)
    stats = ckpt.LoadStats()
    with counting_reads() as reads:
        ckpt.load(state, path, stats=stats)
    expected = _state(0)
    same = all(torch.equal(state[k].view(torch.uint8) if state[k].dtype == torch.bfloat16 else state[k],
                           expected[k].view(torch.uint8) if expected[k].dtype == torch.bfloat16 else expected[k])
               for k in ("w", "v", "b", "e", "h")) and state["step"] == 3
    stored = sum(blob.length for _, blob in manifest.blobs())
    return same, reads.data_bytes(), stats.bytes_read, stats.bytes_received, stats.bytes_sent, stored


@pytest.mark.slow
def test_ddp_load_reads_one_copy_from_storage(tmp_path):
    results = run_ranks(4, _ddp, str(tmp_path / "ckpt"), None)
    assert all(r[0] for r in results)  # bitwise equal on every rank
    stored = results[0][5]
    assert sum(r[1] for r in results) == stored  # one copy in total at the storage layer, not four
    assert [r[2] for r in results] == [r[1] for r in results]  # LoadStats.bytes_read agrees with storage
    assert sum(1 for r in results if r[1]) >= 2  # the reading is spread, not all on rank 0
    assert sum(r[3] for r in results) == sum(r[4] for r in results) > 0  # what was sent was received


@pytest.mark.slow
@pytest.mark.parametrize("key", ["w", "e"])  # a chunk sent alone, one sent in a batch
def test_corrupt_shared_chunk_fails_every_rank(tmp_path, key):
    results = run_ranks(4, _ddp, str(tmp_path / "ckpt"), key)
    assert [r[0] for r in results] == ["corrupt"] * 4, results
    assert all("checksum mismatch" in r[1] for r in results), results


def _hsdp(rank: int, world: int, path: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    placements = [Replicate(), Shard(0)]

    def state(seed):
        full = _state(seed)
        return {k: distribute_tensor(v, mesh, placements) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in full.items()}

    ckpt.save(state(0), path)
    manifest = ckpt.load(state(1), path)
    target = state(1)
    stats = ckpt.LoadStats()
    with counting_reads() as reads:
        ckpt.load(target, path, stats=stats)
    expected = _state(0)
    same = all(torch.equal(target[k].full_tensor().view(torch.uint8), expected[k].view(torch.uint8))
               for k in ("w", "v", "b", "e", "h"))
    stored = sum(blob.length for _, blob in manifest.blobs())
    return same, reads.data_bytes(), stats.bytes_received, stored


@pytest.mark.slow
def test_hsdp_load_reads_one_copy_from_storage(tmp_path):
    results = run_ranks(4, _hsdp, str(tmp_path / "ckpt"))
    assert all(r[0] for r in results)
    assert sum(r[1] for r in results) == results[0][3]  # one copy, not one per replicate group
    assert all(r[2] > 0 for r in results)  # every rank got its shard's half from its replica peer


def test_manager_load_stats_count_what_one_process_read(tmp_path):
    with counting_reads() as reads, ckpt.CheckpointManager(tmp_path / "run", async_mode="sync") as manager:
        manager.save(1, _state(0))  # the wrapper is in place before the manager locates its root
        state = _state(1)
        before = reads.data_bytes()
        assert manager.load(state) == 1
        stats, read = manager.load_stats, reads.data_bytes() - before
    stored = sum(blob.length for _, blob in ckpt.read_manifest(tmp_path / "run" / "step-00000001").blobs())
    assert stats.bytes_read == read == stored and stats.bytes_received == 0
    assert torch.equal(state["w"], _state(0)["w"]) and "from storage" in stats.summary()
