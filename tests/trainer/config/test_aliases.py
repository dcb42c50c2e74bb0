"""trainer/config/aliases.py: the seed's keys must agree with their native spelling in one source;
distributed.dp_size with explicit parallelism degrees."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config


def test_alias_and_native_key_must_agree_in_one_source(tmp_path, write):
    ok = write(tmp_path, "ok.yaml", "training:\n  steps: 5\n  max_steps: 5\n")
    assert load_config(["--config", ok]).training.steps == 5
    bad = write(tmp_path, "bad.yaml", "training:\n  steps: 5\n  max_steps: 6\n")
    with pytest.raises(ConfigError, match="max_steps"):
        load_config(["--config", bad])
    bad = write(tmp_path, "bad2.yaml", "distributed:\n  tp_size: 2\nparallelism:\n  tp: 4\n")
    with pytest.raises(ConfigError, match="tp_size"):
        load_config(["--config", bad])


def test_dp_size_with_explicit_parallelism(tmp_path, write):
    ok = write(tmp_path, "ok.yaml", "distributed:\n  dp_size: 4\nparallelism:\n  dp_replicate: 2\n")
    p = load_config(["--config", ok]).parallelism
    assert (p.dp_replicate, p.dp_shard) == (2, 2)
    bad = write(tmp_path, "bad.yaml", "distributed:\n  dp_size: 4\nparallelism:\n  dp_replicate: 2\n  dp_shard: 4\n")
    with pytest.raises(ConfigError, match="dp_size=4"):
        load_config(["--config", bad])
    bad = write(tmp_path, "bad2.yaml", "distributed:\n  dp_size: 3\nparallelism:\n  dp_replicate: 2\n")
    with pytest.raises(ConfigError, match="not divisible"):
        load_config(["--config", bad])
