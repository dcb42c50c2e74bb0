"""Small chunks read together from an object store (:mod:`ckpt.read.batch`): a load of many small
tensors from the S3 server makes one ranged GET per span of neighbours, not one per tensor, and
each tensor is still verified against its own checksum before it is used; large chunks keep their
own ranged GETs; a local load does not batch. Real moto server on loopback.
"""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.read import batch
from ckpt.storage import remote
from tests.support.s3server import bucket_fs


def _state() -> dict:
    gen = torch.Generator().manual_seed(3)
    state = {f"norm.{i}": torch.randn(64 + 37 * i, generator=gen) for i in range(40)}  # 40 small tensors
    state["big"] = torch.randn(5 << 20, generator=gen)  # 20 MiB, more than one GET: its own two
    return state


def _blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.fixture
def gets(monkeypatch):
    """Every ranged read of an S3 data file: (offset, length)."""
    seen = []
    original = remote.RemoteReader.read_into

    def recording(self, buffer, offset):
        if "/data/" in self.path:
            seen.append((offset, len(memoryview(buffer).cast("B"))))
        return original(self, buffer, offset)

    monkeypatch.setattr(remote.RemoteReader, "read_into", recording)
    return seen


def test_many_small_tensors_load_in_one_get_each_verified(s3_bucket, gets):
    state = _state()
    url = f"{s3_bucket.url}/many"
    ckpt.save(state, url, storage_options=s3_bucket.storage_options)
    live = _blank(state)
    gets.clear()
    ckpt.load(live, url, storage_options=s3_bucket.storage_options)
    for key, value in state.items():
        assert torch.equal(live[key].view(torch.int32), value.view(torch.int32)), key
    manifest = ckpt.read_manifest(url, storage_options=s3_bucket.storage_options)
    big = manifest.tensors["big"].chunks[0].blob
    small = [(o, n) for o, n in gets if not big.offset <= o < big.offset + big.length]
    assert len(small) == 1  # 40 tensors, one read of their span
    assert sorted(n for o, n in gets if big.offset <= o < big.offset + big.length) == [4 << 20, 16 << 20]


def test_a_damaged_small_tensor_in_a_batch_fails_the_load_naming_it(s3_bucket):
    state = _state()
    url = f"{s3_bucket.url}/damaged"
    ckpt.save(state, url, storage_options=s3_bucket.storage_options)
    blob = ckpt.read_manifest(url, storage_options=s3_bucket.storage_options).tensors["norm.7"].chunks[0].blob
    fs = bucket_fs(s3_bucket)
    path = f"{s3_bucket.name}/damaged/{blob.file}"
    data = bytearray(fs.cat_file(path))
    data[blob.offset + 5] ^= 0x10
    fs.pipe_file(path, bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        ckpt.load(_blank(state), url, storage_options=s3_bucket.storage_options)
    assert info.value.tensor == "norm.7"


def test_only_small_neighbours_in_one_file_are_grouped():
    class Blob:
        def __init__(self, file, offset, length):
            self.file, self.offset, self.length, self.codec = file, offset, length, "raw"

    class Chunk:
        def __init__(self, *args):
            self.blob = Blob(*args)

    direct = torch.empty(1)

    def request(file, offset, length, into=direct):
        return (f"k{offset}", Chunk(file, offset, length), [], into)

    requests = [request("a", 0, 100), request("a", 100, 100),  # neighbours: one group
                request("a", 200, 50_000_000),  # too large: alone
                request("a", 50_000_200, 10), request("a", 50_000_210 + (1 << 20), 10),  # gap too wide
                request("b", 0, 10), request("b", 10, 10, into=None),  # not direct: alone
                request("c", 0, 6 << 20), request("c", 6 << 20, 6 << 20), request("c", 12 << 20, 6 << 20)]
    shapes = [len(r) if isinstance(r, list) else 1 for r in batch.batched(requests, 16 << 20)]
    assert shapes == [2, 1, 1, 1, 1, 1, 2, 1]  # the last: 18 MiB would exceed one GET
