"""trainer/config/checkpoint.py: the checkpoint section hands every engine option to SaveOptions; its
choices are the engine's enums."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config


def test_checkpoint_save_options_carry_every_field():
    from ckpt.options import AsyncMode, Compression, FailurePolicy, SaveOptions

    cfg = load_config(["--checkpoint.interval", "7", "--checkpoint.keep", "2", "--checkpoint.keep_every", "20",
                       "--checkpoint.full_every", "4", "--checkpoint.compress", "ZSTD", "--checkpoint.zstd_level", "5"])
    opts = cfg.checkpoint.save_options(device_type="cpu", user_metadata={"config": cfg.to_dict()})
    assert isinstance(opts, SaveOptions)
    assert (opts.interval, opts.keep, opts.keep_every, opts.full_every, opts.zstd_level) == (7, 2, 20, 4, 5)
    assert opts.compress is Compression.ZSTD and opts.async_mode is AsyncMode.DOUBLE_BUFFER
    assert opts.device_type == "cpu" and opts.user_metadata == {"config": cfg.to_dict()}
    assert opts.on_error is FailurePolicy.STOP  # the default: a failed save stops the run
    opts = load_config(["--checkpoint.on_error", "Continue"]).checkpoint.save_options(device_type=None, user_metadata={})
    assert opts.on_error is FailurePolicy.CONTINUE

    opts = load_config(["--checkpoint.async_mode", "sync"]).checkpoint.save_options(device_type=None, user_metadata={})
    assert opts.async_mode is AsyncMode.SYNC and opts.compress is Compression.NONE and opts.keep_every is None
    assert (opts.interval, opts.keep, opts.full_every, opts.zstd_level) == (10, 3, 1, 1)
    assert opts.device_type is None and opts.user_metadata == {}


def test_checkpoint_choices_are_the_engine_enums():
    from ckpt.options import AsyncMode, Compression, FailurePolicy, choices

    for key, kind in (("async_mode", AsyncMode), ("compress", Compression), ("on_error", FailurePolicy)):
        for value in choices(kind):
            assert getattr(load_config([f"--checkpoint.{key}", value]).checkpoint, key) == value
        with pytest.raises(ConfigError, match=rf"checkpoint\.{key}='bogus' is invalid: must be one of "
                                              + ", ".join(choices(kind))):
            load_config([f"--checkpoint.{key}", "bogus"])
