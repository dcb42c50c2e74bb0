"""Hostile DCP checkpoints (issue 22, item 7): ``import_dcp`` / ``ckpt-convert --from dcp`` refuse each
with a CheckpointError subclass, the CLI with exit 1 and one line, within seconds, leaving nothing:
a zstd bomb, sparse data and metadata files claiming gigabytes (MemoryError or minutes of reading
before), a value whose pickle is a memo DAG of 2^40 leaves and 2500 tensors sharing one 2500-chunk
list (past 30 s before), a 5000-deep value (RecursionError), a meta-tensor chunk
(NotImplementedError), a lone-surrogate key (imported, then crashed ckpt-inspect). Data files named
``__0_1`` and ``__0_01`` (FileExistsError before) import. Size bounds count bytes, not elements: a
chunk stored in fewer bytes than its dtype needs, or declaring more bytes than memory holds, is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.convert import import_dcp
from ckpt.convert.dcp.bounds import available_memory
from tests.support import dcp_hostile as hostile
from tests.support import dcp_sources
from tests.support.hangs import ends
from tools import convert

GiB = 1 << 30


def _refused(source: Path, tmp_path: Path, capsys, error: type, *words: str) -> None:
    dst = tmp_path / "out" / "step-00000001"
    with pytest.raises(error) as info:
        ends(lambda: import_dcp(source, dst))  # bounded work: a hang fails, speed is not asserted
    assert all(word in str(info.value) for word in words), str(info.value)
    assert ends(lambda: convert.main([str(source), str(dst), "--from", "dcp", "--quiet"])) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ckpt-convert: error: ") and "writing" not in err, err
    err.encode("ascii")  # printable anywhere
    dcp_sources.leaves_nothing(dst)


@pytest.fixture
def source(small_dcp, tmp_path) -> Path:
    return dcp_sources.copy(small_dcp, tmp_path / "dcp")


def test_zstd_bomb_declaring_terabytes(source, tmp_path, capsys):
    bomb = hostile.zstd_rle_bomb(8 * GiB)  # 256 KiB of RLE blocks
    assert len(bomb) < 300_000
    (source / "bomb.distcp").write_bytes(bomb)
    hostile.add_tensor(source, "big", (1 << 40,), file="bomb.distcp", length=len(bomb),
                       transforms=["stream.zstd/1"])  # 4 TiB of float32
    _refused(source, tmp_path, capsys, ckpt.CheckpointError, "big", "bytes in memory")


def test_zstd_frame_declaring_more_than_its_chunk(source, tmp_path, capsys):
    bomb = hostile.zstd_rle_bomb(8 * GiB, declared=4 << 40)
    hostile.replace_item(source, "w", bomb, transforms=["stream.zstd/1"])
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "w", "declares")


def test_zstd_bomb_in_a_small_chunk_stops_at_its_size(source, tmp_path, capsys):
    hostile.replace_item(source, "w", hostile.zstd_rle_bomb(8 * GiB), transforms=["stream.zstd/1"])
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "decompresses to more")


@pytest.mark.parametrize("head", [b"", b"PK\x03\x04"], ids=["zeros", "zip-head"])
def test_sparse_data_file_claiming_gigabytes(source, tmp_path, capsys, head):
    hostile.sparse_file(source / "sparse.distcp", 8 * GiB, head=head)
    hostile.add_tensor(source, "big", (2 * GiB,), file="sparse.distcp", length=8 * GiB)
    _refused(source, tmp_path, capsys, ckpt.CheckpointError, "big", "sparse.distcp")


def test_chunk_stored_in_fewer_bytes_than_its_box(source, tmp_path, capsys):
    (source / "small.distcp").write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    hostile.add_tensor(source, "big", (1 << 30,), file="small.distcp", length=64)
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "big", "declares")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_chunk_stored_in_as_many_bytes_as_elements_but_fewer_than_its_box_needs(source, tmp_path, capsys, dtype):
    """The bound is in bytes: 1024 elements of a wider dtype stored in itemsize/2 bytes each (at
    least one byte an element) are refused before anything is read."""
    elements = 1024
    length = elements * dtype.itemsize // 2
    (source / "small.distcp").write_bytes(b"PK\x03\x04" + b"\x00" * (length - 4))
    hostile.add_tensor(source, "big", (elements,), file="small.distcp", length=length, dtype=dtype)
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "big",
             f"declares {elements * dtype.itemsize} bytes but small.distcp stores {length}")


def test_compressed_chunk_whose_bytes_but_not_elements_exceed_memory(source, tmp_path, capsys):
    """A zstd chunk of float64 declaring a quarter of this machine's available memory in elements
    (twice of it in bytes) is refused by the memory bound before it is read."""
    available = available_memory()
    if available is None:
        pytest.skip("this machine does not say how much memory is available")
    (source / "packed.distcp").write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 60)
    hostile.add_tensor(source, "big", (available // 4,), file="packed.distcp", length=64, dtype=torch.float64,
                       transforms=["stream.zstd/1"])
    _refused(source, tmp_path, capsys, ckpt.CheckpointError, "big", "bytes in memory")


def test_sparse_metadata_file(source, tmp_path, capsys):
    raw = (source / ".metadata").read_bytes()
    hostile.sparse_file(source / ".metadata", 4 * GiB, head=raw)
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, ".metadata")


def test_value_pickled_as_a_memo_dag_of_2_to_the_40_leaves(source, tmp_path, capsys):
    hostile.replace_item(source, "step", hostile.torch_save_bytes(hostile.memo_dag(40)))
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "step", "elements")


def test_memo_shared_chunk_lists_2500_by_2500(source, tmp_path, capsys):
    hostile.shared_chunk_lists(source, 2500, 2500)  # 390 KB of pickle: ~1 s to unpickle (pure Python), twice
    _refused(source, tmp_path, capsys, ckpt.InvalidManifestError, ".metadata", "elements")


def test_metadata_dict_key_that_is_a_shared_tuple_dag(source, tmp_path, capsys):
    """Hashing a key made of memo-shared tuples would walk all 2^40 leaves while unpickling."""
    import pickle
    import struct

    ops = [pickle.PROTO + b"\x04", pickle.EMPTY_DICT, pickle.SHORT_BINUNICODE + b"\x01x", pickle.TUPLE1,
           pickle.BINPUT + b"\x00"]
    for level in range(40):
        ops += [pickle.POP, pickle.BINGET + bytes([level]), pickle.BINGET + bytes([level]), pickle.TUPLE2,
                pickle.BINPUT + bytes([level + 1])]
    ops += [pickle.BININT1 + struct.pack("B", 1), pickle.SETITEM, pickle.STOP]
    (source / ".metadata").write_bytes(b"".join(ops))
    _refused(source, tmp_path, capsys, ckpt.UnsafeCheckpointError, "dict key")


def test_value_5000_deep(source, tmp_path, capsys):
    hostile.replace_item(source, "step", hostile.torch_save_bytes(hostile.deep_list(5000), recursion=50_000))
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "step", "levels deep")


def test_meta_tensor_chunk(source, tmp_path, capsys):
    hostile.replace_item(source, "w", hostile.torch_save_bytes(torch.empty(8, 8, device="meta")))
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "w", "meta")


def test_meta_tensor_in_a_value(source, tmp_path, capsys):
    hostile.replace_item(source, "step", hostile.torch_save_bytes({"t": torch.empty(3, device="meta")}))
    _refused(source, tmp_path, capsys, ckpt.CorruptCheckpointError, "step", "meta")


def test_lone_surrogate_key_is_refused_at_import(source, tmp_path, capsys):
    """Decision: refused at import (our keys are valid Unicode), so no checkpoint exists that
    ckpt-inspect cannot print."""
    hostile.rename_key(source, "step", "st\udc80ep")
    _refused(source, tmp_path, capsys, ckpt.InvalidManifestError, "not valid Unicode", r"\udc80")


def test_data_files_named_0_1_and_0_01_both_import(source, tmp_path):
    hostile.rename_data_file(source, "__0_0.distcp", "__0_01.distcp")  # beside __0_1.distcp: rank 0, part 1 twice
    dst = tmp_path / "out" / "step-00000001"
    import_dcp(source, dst)
    live = {"w": torch.zeros(8, 8), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0, "seen": None}
    ckpt.load(live, dst, no_dist=True)
    assert live["step"] == 1 and live["seen"] == {1, 3} and torch.equal(live["w"], torch.arange(64.0).reshape(8, 8))
    assert len(ckpt.read_manifest(dst).files) == 2
