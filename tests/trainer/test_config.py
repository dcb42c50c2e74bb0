"""trainer.config: files, overrides, seed-style keys, validation, batch arithmetic, help text."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainer.config import (
    Config,
    ConfigError,
    ModelConfig,
    help_text,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------------------------ files


def test_defaults():
    cfg = load_config([])
    assert cfg == Config()
    assert cfg.training.steps == 100 and cfg.training.batch_size == 8 and cfg.training.lr == 3e-4
    assert cfg.parallelism.dp_shard == -1 and cfg.optimization.zero_stage == 3
    assert cfg.checkpoint.async_mode == "double_buffer" and cfg.checkpoint.load_step is None


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


def test_toml_and_yaml_equal_on_arbitrary_content(tmp_path):
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


def test_unsupported_extension_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="extension"):
        load_config(["--config", write(tmp_path, "a.json", "{}")])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(["--config", write(tmp_path, "bad.toml", "[training\n")])


def test_empty_yaml_is_defaults(tmp_path):
    assert load_config(["--config", write(tmp_path, "e.yaml", "")]) == Config()


# -------------------------------------------------------------------------------- overrides


def test_cli_overrides_file_overrides_defaults(tmp_path):
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


def test_cli_alias_overrides_file_native_key(tmp_path):
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


# ------------------------------------------------------------------------- unknown keys


def test_unknown_key_in_file_lists_valid_keys(tmp_path):
    path = write(tmp_path, "c.toml", "[training]\nstepz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path])
    msg = str(e.value)
    assert "training.stepz" in msg
    for key in ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "max_steps"):
        assert key in msg


def test_unknown_key_in_yaml_seed_section(tmp_path):
    path = write(tmp_path, "c.yaml", "distributed:\n  ep_size: 2\n")
    with pytest.raises(ConfigError, match="tp_size, pp_size, dp_size"):
        load_config(["--config", path])


def test_unknown_key_on_cli_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(["--checkpoint.intervall", "3"])
    msg = str(e.value)
    assert "checkpoint.intervall" in msg and "command line" in msg
    for key in ("enable", "folder", "interval", "async_mode", "keep", "load_step"):
        assert key in msg


def test_unknown_section_lists_sections(tmp_path):
    for argv in (["--config", write(tmp_path, "c.toml", "[trainig]\nsteps = 3\n")], ["--trainig.steps", "3"]):
        with pytest.raises(ConfigError) as e:
            load_config(argv)
        msg = str(e.value)
        assert "trainig" in msg
        for section in ("job", "model", "training", "parallelism", "optimization", "checkpoint", "metrics", "distributed"):
            assert section in msg


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# ------------------------------------------------------------------------------ bad values


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
        (["--checkpoint.async_mode", "async"], "checkpoint.async_mode"),
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
def test_bad_types_in_file(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key):
        load_config(["--config", write(tmp_path, "c.yaml", text)])


def test_part2_values_are_not_rejected_here():
    cfg = load_config(["--parallelism.tp", "2", "--parallelism.pp", "2", "--parallelism.dp_replicate", "2",
                       "--optimization.zero_stage", "0"])
    assert (cfg.parallelism.tp, cfg.parallelism.pp, cfg.parallelism.dp_replicate) == (2, 2, 2)


def test_choice_strings_are_normalised():
    cfg = load_config(["--optimization.precision", "BF16", "--training.device", "CPU"])
    assert cfg.optimization.precision == "bf16" and cfg.training.device == "cpu"


# ------------------------------------------------------------------------- seed-style aliases


def test_alias_and_native_key_must_agree_in_one_source(tmp_path):
    ok = write(tmp_path, "ok.yaml", "training:\n  steps: 5\n  max_steps: 5\n")
    assert load_config(["--config", ok]).training.steps == 5
    bad = write(tmp_path, "bad.yaml", "training:\n  steps: 5\n  max_steps: 6\n")
    with pytest.raises(ConfigError, match="max_steps"):
        load_config(["--config", bad])
    bad = write(tmp_path, "bad2.yaml", "distributed:\n  tp_size: 2\nparallelism:\n  tp: 4\n")
    with pytest.raises(ConfigError, match="tp_size"):
        load_config(["--config", bad])


def test_dp_size_with_explicit_parallelism(tmp_path):
    ok = write(tmp_path, "ok.yaml", "distributed:\n  dp_size: 4\nparallelism:\n  dp_replicate: 2\n")
    p = load_config(["--config", ok]).parallelism
    assert (p.dp_replicate, p.dp_shard) == (2, 2)
    bad = write(tmp_path, "bad.yaml", "distributed:\n  dp_size: 4\nparallelism:\n  dp_replicate: 2\n  dp_shard: 4\n")
    with pytest.raises(ConfigError, match="dp_size=4"):
        load_config(["--config", bad])
    bad = write(tmp_path, "bad2.yaml", "distributed:\n  dp_size: 3\nparallelism:\n  dp_replicate: 2\n")
    with pytest.raises(ConfigError, match="not divisible"):
        load_config(["--config", bad])


# ------------------------------------------------------------------------------ resolve_batch


def batch(b, m=None, g=None):
    cfg = Config()
    cfg.training.batch_size, cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps = b, m, g
    return cfg


@pytest.mark.parametrize(
    "b,m,g,dp,expected",
    [
        (8, None, None, 2, (4, 1)),  # defaults: accumulation 1, micro = batch // dp
        (8, None, None, 1, (8, 1)),
        (8, 2, None, 2, (2, 2)),  # accumulation derived
        (8, None, 4, 2, (1, 4)),  # micro derived
        (8, 2, 2, 2, (2, 2)),  # all given, consistent
        (256, 1, 8, 32, (1, 8)),
    ],
)
def test_resolve_batch(b, m, g, dp, expected):
    m2, g2 = batch(b, m, g).resolve_batch(dp)
    assert (m2, g2) == expected
    assert m2 * g2 * dp == b


@pytest.mark.parametrize(
    "b,m,g,dp,pattern",
    [
        (8, 2, 2, 4, r"batch_size=8 must equal .*micro_batch_size=2 x .*gradient_accumulation_steps=2 x data-parallel degree 4 = 16"),
        (8, None, None, 3, r"batch_size=8 is not divisible by .*gradient_accumulation_steps=1 x data-parallel degree 3 = 3"),
        (8, 3, None, 1, r"batch_size=8 is not divisible by .*micro_batch_size=3 x data-parallel degree 1 = 3"),
        (8, None, 3, 2, r"gradient_accumulation_steps=3 x data-parallel degree 2 = 6"),
        (2, None, None, 4, r"batch_size=2 is not divisible"),
    ],
)
def test_resolve_batch_inconsistent(b, m, g, dp, pattern):
    with pytest.raises(ConfigError, match=pattern):
        batch(b, m, g).resolve_batch(dp)


def test_resolve_batch_bad_degree():
    with pytest.raises(ConfigError):
        Config().resolve_batch(0)


# ---------------------------------------------------------------------------- dict and help


def test_to_dict_round_trip():
    cfg = load_config(["--config", str(CONFIGS / "seed_70b.yaml")])
    d = cfg.to_dict()
    assert d["parallelism"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 4, "pp": 4, "pp_schedule": "1f1b",
                                "pp_microbatches": None, "pp_virtual_stages": 1}
    assert d["model"]["flavor"] == "70B" and "size" not in d["model"]
    assert set(d) == {"job", "model", "training", "parallelism", "optimization", "checkpoint", "metrics"}
    assert Config.from_dict(d) == cfg


def test_validate_hand_built_config():
    cfg = Config(model=ModelConfig(n_layers=0))
    with pytest.raises(ConfigError, match="model.n_layers"):
        cfg.validate()


def test_help_text_mentions_every_field():
    text = help_text()
    lines = text.splitlines()
    for f_sec in dataclasses.fields(Config):
        for f in dataclasses.fields(type(getattr(Config(), f_sec.name))):
            flag = f"--{f_sec.name}.{f.name} "
            idx = next(i for i, line in enumerate(lines) if line.strip().startswith(flag))
            assert "default:" in lines[idx]
            assert lines[idx + 1].strip(), f"no help for {flag}"  # the docstring line
    for alias in ("--model.size", "--training.max_steps", "--distributed.tp_size", "--distributed.pp_size",
                  "--distributed.dp_size"):
        assert alias in text


# --------------------------------------------------------------------------- engine options


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
