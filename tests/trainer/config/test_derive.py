"""trainer/config/derive.py: the batch split (micro batch x accumulation x data-parallel degree)."""

from __future__ import annotations

import pytest

from trainer.config import Config, ConfigError


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


# ------------------------------------------------------------------ the model's numerics (llama-3 family)

from trainer.config import load_config  # noqa: E402
from trainer.model import FLAVORS, ffn_hidden_dim  # noqa: E402
from trainer.rope import RopeScaling  # noqa: E402


def test_explicit_numerics_keys_override_the_flavor():
    args = load_config(["--model.rope_theta", "500000", "--model.norm_eps", "1e-6", "--model.ffn_dim", "300",
                        "--model.tie_embeddings", "--model.rope_scaling", "llama3", "--model.rope_factor", "32",
                        "--model.max_seq_len", "4096"]).model_args(258)
    assert (args.rope_theta, args.norm_eps, ffn_hidden_dim(args), args.tie_embeddings, args.max_seq_len) == \
        (500000.0, 1e-6, 300, True, 4096)
    assert args.rope_scaling == RopeScaling(factor=32.0)  # the other factors: Llama-3.1's
    assert load_config(["--model.multiple_of", "100"]).model_args(258).ffn_dim is None
    assert ffn_hidden_dim(load_config(["--model.multiple_of", "100"]).model_args(258)) == 400  # 341 -> 400
    plain = load_config([]).model_args(258)  # nothing given: the flavor's
    assert (plain.rope_theta, plain.rope_scaling, plain.tie_embeddings, plain.norm_eps) == (10000.0, None, False, 1e-5)


def test_llama3_flavors_and_torchtitan_names():
    debug = load_config(["--model.flavor", "debugmodel"]).model_args(258)
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.rope_theta) == (256, 6, 16, 500000.0)
    assert debug.rope_scaling == RopeScaling() and debug.vocab_size == 258  # the tokenizer's vocabulary
    eight = load_config(["--model.name", "llama3", "--model.flavor", "8B"]).model_args(None)
    assert eight == FLAVORS["llama3-8b"] and ffn_hidden_dim(eight) == 14336
    assert ffn_hidden_dim(FLAVORS["llama3-70b"]) == 28672 and FLAVORS["llama3-1b"].tie_embeddings
    assert load_config(["--model.flavor", "70B"]).model_args(None).rope_theta == 10000.0  # llama: Llama-2's 70B
    unscaled = load_config(["--model.flavor", "debugmodel", "--model.rope_scaling", "default"]).model_args(258)
    assert unscaled.rope_scaling is None


@pytest.mark.parametrize("argv, words", [
    (["--model.name", "llama3", "--model.flavor", "9B"], "torchtitan's llama3 flavors"),
    (["--model.rope_factor", "4"], "set model.rope_scaling = llama3"),
    (["--model.rope_scaling", "default", "--model.rope_factor", "4"], "apply to rope_scaling = llama3 only"),
    (["--model.rope_scaling", "yarn"], "must be default"),
    (["--model.rope_scaling", "llama3", "--model.rope_low_freq_factor", "5"], "low_freq_factor < high_freq_factor"),
    (["--model.ffn_dim", "300", "--model.multiple_of", "64"], "leave multiple_of"),
    (["--model.norm_eps", "0"], "must be > 0"),
    (["--model.max_seq_len", "64"], "at least training.seq_len=128"),
    (["--model.tie_embeddings", "--parallelism.tp", "2"], "tie_embeddings"),
    (["--model.tie_embeddings", "--parallelism.pp", "2"], "tie_embeddings"),
])
def test_numerics_that_cannot_work_are_refused_naming_the_key(argv, words):
    with pytest.raises(ConfigError, match=words):
        load_config(argv)
