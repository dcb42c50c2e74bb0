"""trainer/config/validate.py: bad values and types name the key; choices normalised; what only the
parallel layer can judge is not rejected here; a hand-built Config is validated like a parsed one."""

from __future__ import annotations

import pytest

from trainer.config import Config, ConfigError, ModelConfig, load_config


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "argv,key",
    [
        (["--training.steps", "ten"], "training.steps"),
        (["--training.steps", "-1"], "training.steps"),
        (["--training.steps", "1.5"], "training.steps"),
        (["--training.lr", "fast"], "training.lr"),
        (["--training.lr", "0"], "training.lr"),
        (["--training.lr", "nan"], "training.lr"),
        (["--training.batch_size", "0"], "training.batch_size"),
        (["--training.micro_batch_size", "0"], "training.micro_batch_size"),
        (["--training.min_lr_ratio", "2"], "training.min_lr_ratio"),
        (["--training.max_norm", "-1"], "training.max_norm"),
        (["--training.device", "tpu"], "training.device"),
        (["--training.seq_len", "none"], "training.seq_len"),
        (["--optimization.precision", "fp8"], "optimization.precision"),
        (["--optimization.zero_stage", "4"], "optimization.zero_stage"),
        (["--optimization.gradient_checkpointing", "maybe"], "optimization.gradient_checkpointing"),
        (["--checkpoint.async_mode", "asynchronous"], "checkpoint.async_mode"),
        (["--checkpoint.interval", "0"], "checkpoint.interval"),
        (["--checkpoint.keep", "0"], "checkpoint.keep"),
        (["--parallelism.dp_shard", "0"], "parallelism.dp_shard"),
        (["--parallelism.tp", "0"], "parallelism.tp"),
        (["--metrics.log_freq", "0"], "metrics.log_freq"),
        (["--model.name", "gpt"], "model.name"),
        (["--model.hidden_dim", "100", "--model.n_heads", "3"], "model.hidden_dim"),
        (["--model.n_heads", "8", "--model.n_kv_heads", "3"], "model.n_kv_heads"),
        (["--distributed.dp_size", "0"], "distributed.dp_size"),
    ],
)
def test_bad_values_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(argv)


@pytest.mark.parametrize(
    "text,key",
    [
        ("training:\n  steps: ten\n", "training.steps"),
        ("training:\n  steps: 3.0\n", "training.steps"),
        ("training:\n  steps: true\n", "training.steps"),
        ("checkpoint:\n  enable: 2\n", "checkpoint.enable"),
        ("model:\n  size: 70\n", r"model\.flavor expects a string.*given as model\.size"),
        ("training:\n  steps: null\n", "training.steps"),
        ("training: 3\n", "training"),
        ("- 1\n", "top level"),
    ],
)
def test_bad_types_in_file(tmp_path, text, key, write):
    with pytest.raises(ConfigError, match=key):
        load_config(["--config", write(tmp_path, "c.yaml", text)])


def test_part2_values_are_not_rejected_here():
    cfg = load_config(["--parallelism.tp", "2", "--parallelism.pp", "2", "--parallelism.dp_replicate", "2",
                       "--optimization.zero_stage", "0"])
    assert (cfg.parallelism.tp, cfg.parallelism.pp, cfg.parallelism.dp_replicate) == (2, 2, 2)


def test_choice_strings_are_normalised():
    cfg = load_config(["--optimization.precision", "BF16", "--training.device", "CPU"])
    assert cfg.optimization.precision == "bf16" and cfg.training.device == "cpu"


def test_validate_hand_built_config():
    cfg = Config(model=ModelConfig(n_layers=0))
    with pytest.raises(ConfigError, match="model.n_layers"):
        cfg.validate()
