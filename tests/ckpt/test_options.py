"""ckpt.options: one typed, validated object for the manager, the writer and the trainer."""

from __future__ import annotations

import pytest
import torch

from ckpt import AsyncMode, BusyPolicy, CheckpointManager, Compression, SaveOptions
from ckpt.dcp import Writer


def test_strings_become_enums_and_defaults():
    options = SaveOptions(async_mode="SYNC", policy="skip", compress=None)
    assert (options.async_mode, options.policy, options.compress) == (AsyncMode.SYNC, BusyPolicy.SKIP,
                                                                      Compression.NONE)
    assert SaveOptions(compress="zstd").compress is Compression.ZSTD
    assert SaveOptions().async_mode is AsyncMode.DOUBLE_BUFFER and SaveOptions().policy is BusyPolicy.BLOCK


@pytest.mark.parametrize("fields, message", [
    ({"async_mode": "later"}, "async_mode must be one of double_buffer, sync"),
    ({"policy": "drop"}, "policy must be one of block, skip"),
    ({"compress": "lz4"}, "compress must be one of none, zstd"),
    ({"interval": 0}, "interval must be a positive integer"),
    ({"keep": -1}, "keep must be a positive integer"),
    ({"keep_every": 0}, "keep_every must be a positive integer"),
    ({"full_every": True}, "full_every must be a positive integer"),
    ({"files_per_rank": 1.5}, "files_per_rank must be a positive integer"),
    ({"full_every": 4, "async_mode": "sync"}, "need async_mode='double_buffer'"),
])
def test_bad_values_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        SaveOptions(**fields)


def test_manager_and_writer_take_one_options_object_and_overrides(tmp_path):
    options = SaveOptions(interval=5, keep=2, compress="zstd", user_metadata={"run": "a"})
    with CheckpointManager(tmp_path / "root", options, keep=4) as manager:
        assert manager.options == options.replace(keep=4) and options.keep == 2
        assert [manager.save(s, {"x": torch.ones(3)}) for s in (4, 5)] == [False, True]
    writer = Writer(tmp_path / "w", options=options, files_per_rank=3)
    assert writer.options.files_per_rank == 3 and writer.options.compress is Compression.ZSTD
    with pytest.raises(TypeError):
        CheckpointManager(tmp_path / "other", no_such_option=1)
