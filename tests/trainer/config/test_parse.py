"""trainer/config/parse.py: files by extension, command-line overrides over files over defaults, unknown
sections and keys listing the valid ones, the --help text."""

from __future__ import annotations

import dataclasses

import pytest

from tests.support import REPO
from trainer.config import Config, ConfigError, help_text, load_config

CONFIGS = REPO / "configs"


# ---------------------------------------------------------------------------------------- files


def test_debug_toml_and_yaml_give_the_same_config():
    toml_cfg = load_config(["--config", str(CONFIGS / "debug.toml")])
    yaml_cfg = load_config(["--config", str(CONFIGS / "debug.yaml")])
    assert toml_cfg == yaml_cfg
    assert toml_cfg.to_dict() == yaml_cfg.to_dict()
    t = toml_cfg.training
    assert (t.steps, t.batch_size, t.seq_len, t.lr, t.warmup_steps) == (300, 8, 128, 1e-3, 20)
    assert isinstance(yaml_cfg.training.lr, float)  # YAML's `1e-3` is a string, coerced
    c = toml_cfg.checkpoint
    assert (c.enable, c.interval, c.keep) == (True, 50, 3)
    assert toml_cfg.metrics.log_freq == 10 and toml_cfg.job.dump_folder == "outputs/debug"
    assert toml_cfg.optimization.zero_stage == 3 and toml_cfg.optimization.precision == "fp32"
    assert toml_cfg.model.flavor == "debug" and toml_cfg.parallelism.dp_shard == -1


def test_toml_and_yaml_equal_on_arbitrary_content(tmp_path, write):
    t = write(tmp_path, "a.toml", '[training]\nsteps = 7\nlr = 2e-4\n[checkpoint]\nkeep_every = 5\nenable = true\n')
    y = write(tmp_path, "a.yml", "training:\n  max_steps: 7\n  lr: 2e-4\ncheckpoint:\n  keep_every: 5\n  enable: yes\n")
    assert load_config(["--config", t]) == load_config(["--config", y])


def test_seed_yaml_maps_every_value():
    cfg = load_config(["--config", str(CONFIGS / "seed_70b.yaml")])
    m, t, p, o = cfg.model, cfg.training, cfg.parallelism, cfg.optimization
    assert (m.name, m.flavor, m.vocab_size, m.hidden_dim, m.n_layers, m.n_heads) == ("LLaMA", "70B", 32000, 8192, 80, 64)
    assert (t.batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (256, 1, 8)
    assert t.lr == 1e-4 and isinstance(t.lr, float)
    assert (t.warmup_steps, t.steps) == (1000, 100000)
    assert (p.tp, p.pp, p.dp_shard, p.dp_replicate) == (4, 4, 4, 1)
    assert (o.precision, o.gradient_checkpointing, o.zero_stage) == ("bf16", True, 2)
    # the seed's numbers do not multiply up: 1 x 8 x dp 4 = 32 != 256
    with pytest.raises(ConfigError, match="256.*32"):
        cfg.resolve_batch(4)


def test_unsupported_extension_and_missing_file(tmp_path, write):
    with pytest.raises(ConfigError, match="extension"):
        load_config(["--config", write(tmp_path, "a.json", "{}")])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(["--config", write(tmp_path, "bad.toml", "[training\n")])


def test_empty_yaml_is_defaults(tmp_path, write):
    assert load_config(["--config", write(tmp_path, "e.yaml", "")]) == Config()


# ------------------------------------------------------------------------------------ overrides


def test_cli_overrides_file_overrides_defaults(tmp_path, write):
    path = write(tmp_path, "c.toml", "[training]\nsteps = 40\nlr = 1e-3\n[metrics]\nlog_freq = 5\n")
    cfg = load_config(["--config", path, "--training.steps", "12", "--metrics.log_freq=2"])
    assert cfg.training.steps == 12  # CLI beats file
    assert cfg.metrics.log_freq == 2
    assert cfg.training.lr == 1e-3  # file beats default
    assert cfg.training.seq_len == 128  # default
    # order of --config relative to overrides does not matter
    assert load_config(["--training.steps", "12", "--config", path]).training.steps == 12
    # last occurrence wins
    assert load_config(["--training.steps", "3", "--training.steps", "4"]).training.steps == 4


def test_cli_alias_overrides_file_native_key(tmp_path, write):
    path = write(tmp_path, "c.toml", "[training]\nsteps = 40\n")
    assert load_config(["--config", path, "--training.max_steps", "9"]).training.steps == 9
    cfg = load_config(["--model.size", "7B", "--distributed.tp_size", "2", "--distributed.dp_size=3"])
    assert (cfg.model.flavor, cfg.parallelism.tp, cfg.parallelism.dp_shard, cfg.parallelism.dp_replicate) == (
        "7B", 2, 3, 1)


@pytest.mark.parametrize(
    "text,expected",
    [("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("no", False), ("True", True)],
)
def test_cli_booleans(text, expected):
    assert load_config(["--checkpoint.enable", text]).checkpoint.enable is expected


def test_bare_boolean_flag_and_none():
    cfg = load_config(["--checkpoint.enable", "--optimization.compile", "--checkpoint.keep_every", "none"])
    assert cfg.checkpoint.enable is True and cfg.optimization.compile is True and cfg.checkpoint.keep_every is None
    cfg = load_config(["--checkpoint.enable", "--checkpoint.load_step", "20", "--model.n_kv_heads=2", "--parallelism.dp_shard", "-1"])
    assert cfg.checkpoint.load_step == 20 and cfg.model.n_kv_heads == 2 and cfg.parallelism.dp_shard == -1
    assert load_config(["--model.tokenizer", "none"]).model.tokenizer is None
    assert load_config(["--model.tokenizer", "/x/tokenizer.json"]).model.tokenizer == "/x/tokenizer.json"


def test_cli_types_coerced():
    cfg = load_config(["--training.lr", "5e-4", "--training.max_norm", "0", "--job.seed", "7"])
    assert cfg.training.lr == 5e-4 and cfg.training.max_norm == 0.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.job.seed == 7


def test_cli_missing_value_and_stray_arguments():
    with pytest.raises(ConfigError, match="needs a value"):
        load_config(["--training.steps"])
    with pytest.raises(ConfigError, match="needs a path"):
        load_config(["--config"])
    with pytest.raises(ConfigError, match="unexpected command-line argument"):
        load_config(["steps=3"])
    with pytest.raises(ConfigError, match="unexpected command-line argument"):
        load_config(["--dry-run"])


# --------------------------------------------------------------------------------- unknown keys


def test_unknown_key_in_file_lists_valid_keys(tmp_path, write):
    path = write(tmp_path, "c.toml", "[training]\nstepz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path])
    msg = str(e.value)
    assert "training.stepz" in msg
    for key in ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "max_steps"):
        assert key in msg


def test_unknown_key_in_yaml_seed_section(tmp_path, write):
    path = write(tmp_path, "c.yaml", "distributed:\n  sp_size: 2\n")
    with pytest.raises(ConfigError, match="tp_size, pp_size, dp_size"):
        load_config(["--config", path])


def test_unknown_key_on_cli_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(["--checkpoint.intervall", "3"])
    msg = str(e.value)
    assert "checkpoint.intervall" in msg and "command line" in msg
    for key in ("enable", "folder", "interval", "async_mode", "keep", "load_step"):
        assert key in msg


def test_unknown_section_lists_sections(tmp_path, write):
    for argv in (["--config", write(tmp_path, "c.toml", "[trainig]\nsteps = 3\n")], ["--trainig.steps", "3"]):
        with pytest.raises(ConfigError) as e:
            load_config(argv)
        msg = str(e.value)
        assert "trainig" in msg
        for section in ("job", "model", "training", "parallelism", "optimization", "checkpoint", "metrics", "distributed"):
            assert section in msg


# ----------------------------------------------------------------------------------------- help


def test_help_text_mentions_every_field():
    text = help_text()
    lines = text.splitlines()
    assert any(line.startswith("--dry-run ") for line in lines)  # the plan, not a config key
    for f_sec in dataclasses.fields(Config):
        for f in dataclasses.fields(type(getattr(Config(), f_sec.name))):
            flag = f"--{f_sec.name}.{f.name} "
            idx = next(i for i, line in enumerate(lines) if line.strip().startswith(flag))
            assert "default:" in lines[idx]
            assert lines[idx + 1].strip(), f"no help for {flag}"  # the docstring line
    for alias in ("--model.size", "--training.max_steps", "--distributed.tp_size", "--distributed.pp_size",
                  "--distributed.dp_size"):
        assert alias in text
