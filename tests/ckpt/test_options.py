"""ckpt.options: one typed, validated object for the manager, the writer and the trainer."""

from __future__ import annotations

import pytest
import torch

from ckpt import (AsyncMode, BusyPolicy, CheckpointError, CheckpointManager, Compression, InvalidOptionError,
                  SaveOptions)
from ckpt.dcp import Writer


def test_strings_become_enums_and_defaults():
    options = SaveOptions(async_mode="SYNC", policy="skip", compress=None)
    assert (options.async_mode, options.policy, options.compress) == (AsyncMode.SYNC, BusyPolicy.SKIP,
                                                                      Compression.NONE)
    assert SaveOptions(compress="zstd").compress is Compression.ZSTD
    assert SaveOptions().async_mode is AsyncMode.DOUBLE_BUFFER and SaveOptions().policy is BusyPolicy.BLOCK


@pytest.mark.parametrize("fields, message", [
    ({"async_mode": "later"}, "async_mode='later' is invalid: must be one of double_buffer, sync"),
    ({"policy": "drop"}, "policy='drop' is invalid: must be one of block, skip"),
    ({"compress": "lz4"}, "compress='lz4' is invalid: must be one of none, zstd"),
    ({"interval": 0}, "interval=0 is invalid: must be an integer >= 1"),
    ({"keep": -1}, "keep=-1 is invalid"),
    ({"keep_every": 0}, "keep_every=0 is invalid"),
    ({"full_every": True}, "full_every=True is invalid"),
    ({"files_per_rank": 1.5}, "files_per_rank=1.5 is invalid"),
    ({"full_every": 4, "async_mode": "sync"}, "full_every=4 is invalid: deltas .* need async_mode double_buffer"),
])
def test_bad_values_are_named(fields, message):
    with pytest.raises(InvalidOptionError, match=message) as info:
        SaveOptions(**fields)
    assert isinstance(info.value, ValueError) and isinstance(info.value, CheckpointError)
    assert info.value.option == next(iter(fields))


def test_manager_and_writer_take_one_options_object_and_overrides(tmp_path):
    options = SaveOptions(interval=5, keep=2, compress="zstd", user_metadata={"run": "a"})
    with CheckpointManager(tmp_path / "root", options, keep=4) as manager:
        assert manager.options == options.replace(keep=4) and options.keep == 2
        assert [manager.save(s, {"x": torch.ones(3)}) for s in (4, 5)] == [False, True]
    writer = Writer(tmp_path / "w", options=options, files_per_rank=3)
    assert writer.options.files_per_rank == 3 and writer.options.compress is Compression.ZSTD
    with pytest.raises(TypeError):
        CheckpointManager(tmp_path / "other", no_such_option=1)
