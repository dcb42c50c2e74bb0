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


TORCHTITAN_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "byte"

[optimizer]
lr = 8e-4
weight_decay = 0.1

[lr_scheduler]
warmup_steps = 2
min_lr_factor = 0.0

[training]
local_batch_size = 4
global_batch_size = 8
seq_len = 256
max_norm = 1.0
steps = 10
mixed_precision_param = "bfloat16"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"

[checkpoint]
enable = true
folder = "checkpoint"
interval = 10
keep_latest_k = 0
async_mode = "async_with_pinned_mem"

[metrics]
log_freq = 1
enable_tensorboard = false

[compile]
enable = false
"""


def test_a_torchtitan_toml_needs_no_edits_for_the_keys_that_mean_the_same(tmp_path, write):
    cfg = load_config(["--config", write(tmp_path, "titan.toml", TORCHTITAN_TOML)])
    t, p, c, o = cfg.training, cfg.parallelism, cfg.checkpoint, cfg.optimization
    assert (t.micro_batch_size, t.batch_size, t.lr, t.warmup_steps, t.min_lr_ratio) == (4, 8, 8e-4, 2, 0.0)
    assert (p.dp_shard, p.tp, p.pp, p.pp_schedule, o.precision, o.compile) == (-1, 1, 1, "interleaved1f1b", "bf16", False)
    assert (c.enable, c.keep, c.async_mode) == (True, 10**9, "double_buffer")
    assert cfg.model.tokenizer == "byte" and cfg.model_args(258).dim == 256  # debugmodel's shapes
    assert load_config(["--parallelism.tensor_parallel_degree", "2", "--checkpoint.async_mode", "disabled",
                        "--checkpoint.keep_latest_k", "2"]).checkpoint.keep == 2
    with pytest.raises(ConfigError, match="set training.batch_size"):
        load_config(["--training.global_batch_size", "-1"])
    with pytest.raises(ConfigError, match="tensor_parallel_degree.*tp"):
        load_config(["--parallelism.tp", "2", "--parallelism.tensor_parallel_degree", "4"])  # must agree
    with pytest.raises(ConfigError, match=r"unknown key optimizer.name .*lr \(torchtitan: = training.lr\)"):
        load_config(["--optimizer.name", "AdamW"])


def test_the_migration_page_lists_every_alias():
    from tests.support import REPO
    from trainer.config.aliases import TORCHTITAN_KEYS

    page = (REPO / "docs" / "MIGRATING_FROM_TORCHTITAN.md").read_text()
    for (section, key), (to_section, to_key) in TORCHTITAN_KEYS.items():
        assert f"{section}.{key}" in page or f"`{key}`" in page, (section, key)
        assert f"{to_section}.{to_key}" in page or to_key in page, (to_section, to_key)
