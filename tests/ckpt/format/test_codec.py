"""ckpt.format.codec: every codec round-trips every bit pattern of every dtype; zstd (byte-plane) full
checkpoints load bitwise."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.format import codec
from tests.support.checkpoints import step_path
from tests.support import models
from tests.support.chains import load_mixed as _load
from tests.support.chains import train_with_chain as _train_with_chain

CODEC_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                torch.int16, torch.uint8, torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CODEC_DTYPES), st.integers(0, 300), st.integers(0, 2**32 - 1), st.floats(0, 1))
def test_codecs_round_trip_every_bit_pattern(dtype, n, seed, change):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    current = base.copy()
    flip = rng.random(current.size) < change
    current[flip] = rng.integers(0, 256, int(flip.sum()), dtype=np.uint8)
    for encoded, reference in ((codec.encode_delta(current, base, dtype.itemsize, 1), base),
                               (codec.encode_planes(current, dtype.itemsize, 1), None)):
        decoded = codec.decode(encoded.codec, encoded.data, raw_length=current.nbytes, itemsize=dtype.itemsize,
                               planes=encoded.planes, base=reference)
        assert np.array_equal(decoded, current)


def test_zstd_full_checkpoints(tmp_path):
    expected = _train_with_chain(tmp_path, steps=2, compress="zstd")
    manifest = ckpt.read_manifest(step_path(tmp_path, 2))
    assert manifest.kind == "full" and {c.blob.codec for e in manifest.tensors.values() for c in e.chunks} == {"planes"}
    models.assert_same(_load(step_path(tmp_path, 2)), expected[2])
