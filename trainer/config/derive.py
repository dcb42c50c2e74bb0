"""What a configuration implies: the model's shapes and the batch split for a data-parallel degree.

Contract: both take the configuration's sections (any object with ``model``/``training`` sections:
a :class:`trainer.config.Config`, whose methods of the same names call these) and raise
:class:`ConfigError` naming the keys and spelling out the arithmetic when the values cannot work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .schema import ConfigError
from ..model import FLAVORS, LLAMA3_FLAVORS, ModelArgs
from ..rope import RopeScaling
from ..model import model_args as flavor_args


NUMERIC_KEYS = ("ffn_dim", "multiple_of", "ffn_dim_multiplier", "norm_eps", "rope_theta", "tie_embeddings",
                "num_experts", "top_k", "num_shared_experts", "moe_ffn_dim", "moe_aux_loss_coef")
"""``model.*`` keys passed to the model's arguments under the same name, overriding the flavor."""
ROPE_FACTOR_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                    "rope_high_freq_factor": "high_freq_factor",
                    "rope_original_max_positions": "original_max_position_embeddings"}
"""``model.rope_*`` keys -> the fields of :class:`trainer.model.RopeScaling` they set."""
FAMILIES = ("llama", "llama3")


def flavor_key(m: Any) -> str:
    """The key of :data:`trainer.model.FLAVORS` the ``model`` section names: the flavor, looked up
    among torchtitan's llama3 names when ``model.name`` is "llama3" (ConfigError when unknown)."""
    flavor = m.flavor.lower()
    if m.name.lower() == "llama3" and flavor not in FLAVORS:
        if flavor not in LLAMA3_FLAVORS:
            raise ConfigError(f"model.flavor={m.flavor!r} is invalid for model.name='llama3': must be one of "
                              f"{', '.join(LLAMA3_FLAVORS)} (torchtitan's llama3 flavors) or {', '.join(FLAVORS)}")
        return LLAMA3_FLAVORS[flavor]
    if flavor not in FLAVORS:
        raise ConfigError(f"model.flavor={m.flavor!r} is invalid: must be one of {', '.join(FLAVORS)}")
    return flavor


def _rope_scaling(m: Any, flavor: ModelArgs) -> RopeScaling | bool | None:
    """The rotary scaling ``model.rope_scaling`` and the ``rope_*`` factors give (False: none,
    None: the flavor's unchanged)."""
    factors = {field: getattr(m, key) for key, field in ROPE_FACTOR_KEYS.items() if getattr(m, key) is not None}
    kind = None if m.rope_scaling is None else m.rope_scaling.strip().lower()
    if kind not in (None, "default", "llama3"):
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} is invalid: must be default (no scaling) or llama3 (none: the flavor's)")
    if kind == "default":
        if factors:
            raise ConfigError(f"model.rope_scaling='default' with model.{next(iter(factors))} set: the factors "
                              "apply to rope_scaling = llama3 only")
        return False
    if kind is None and not factors:
        return None
    if kind is None and flavor.rope_scaling is None:
        raise ConfigError(f"model.{next(k for k, f in ROPE_FACTOR_KEYS.items() if f in factors)} is set but the "
                          f"flavor has no rope scaling: set model.rope_scaling = llama3 too")
    base = flavor.rope_scaling or RopeScaling()
    try:
        return dataclasses.replace(base, **factors)
    except ValueError as e:
        raise ConfigError(f"model.rope_* = {factors} cannot work: {e}") from None


def model_args(cfg: Any, tokenizer_vocab_size: int | None) -> ModelArgs:
    """The model's shapes and numerics: the flavor's, overridden by the explicit ``model.*`` values,
    the vocabulary the tokenizer's unless given, with room for ``training.seq_len`` positions
    (``model.max_seq_len`` when given).

    Raises ConfigError naming the keys when they cannot work: an unknown flavor, dimensions
    that do not divide, or ``model.vocab_size`` below ``tokenizer_vocab_size`` (None: not
    checked), whose token ids the embedding would not have.
    """
    m = cfg.model
    key = flavor_key(m)
    if None not in (m.vocab_size, tokenizer_vocab_size) and m.vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: the tokenizer has {tokenizer_vocab_size} "
                          "tokens, so it must be at least that (or none for the tokenizer's)")
    if m.max_seq_len is not None and m.max_seq_len < cfg.training.seq_len:
        raise ConfigError(f"model.max_seq_len={m.max_seq_len} is invalid: must be at least "
                          f"training.seq_len={cfg.training.seq_len}")
    given = {key: getattr(m, key) for key in ("hidden_dim", "n_layers", "n_heads", "n_kv_heads", *NUMERIC_KEYS)
             if getattr(m, key) is not None}
    shape = {"dim" if key == "hidden_dim" else key: value for key, value in given.items()}
    max_seq_len = m.max_seq_len or max(cfg.training.seq_len, FLAVORS[key].max_seq_len)
    try:
        return flavor_args(key, vocab_size=m.vocab_size or tokenizer_vocab_size, **shape,
                           rope_scaling=_rope_scaling(m, FLAVORS[key]), max_seq_len=max_seq_len)
    except ValueError as e:
        named = "".join(f", model.{key}={value}" for key, value in given.items())
        raise ConfigError(f"model.flavor={m.flavor!r}{named} cannot work: {e}") from None


def resolve_batch(cfg: Any, dp_degree: int) -> tuple[int, int]:
    """(micro_batch_size, gradient_accumulation_steps) for a data-parallel degree.

    They satisfy ``batch_size == micro_batch_size * gradient_accumulation_steps * dp_degree``:
    ``batch_size`` is the GLOBAL batch, as the seeds' own files mean it (``batch_size: 256  #
    全局总Batch``, "global total batch"). Missing values are derived (accumulation defaults to 1);
    inconsistent or non-divisible combinations raise ConfigError with the arithmetic spelled out
    and the fix named (the accumulation that keeps the global batch, or the batch the other keys
    give): three explicit keys that disagree are not guessed between.
    """
    if isinstance(dp_degree, bool) or not isinstance(dp_degree, int) or dp_degree < 1:
        raise ConfigError(f"data-parallel degree must be a positive integer, not {dp_degree!r}")
    t = cfg.training
    b, m, g, dp = t.batch_size, t.micro_batch_size, t.gradient_accumulation_steps, dp_degree
    if m is not None and g is not None:
        if m * g * dp != b:
            keep = (f"to keep the global batch of {b} set training.gradient_accumulation_steps={b // (m * dp)} "
                    "(or leave it out: it is derived), or " if b % (m * dp) == 0 else "")
            raise ConfigError(
                f"training.batch_size={b} must equal training.micro_batch_size={m} x "
                f"training.gradient_accumulation_steps={g} x data-parallel degree {dp} = {m * g * dp}; "
                f"{keep}set training.batch_size={m * g * dp} for {g} micro-steps of {m}"
            )
        return m, g
    if m is not None:
        if b % (m * dp):
            raise ConfigError(
                f"training.batch_size={b} is not divisible by training.micro_batch_size={m} x "
                f"data-parallel degree {dp} = {m * dp}, so no gradient_accumulation_steps fits"
            )
        return m, b // (m * dp)
    g = 1 if g is None else g
    if b % (g * dp):
        raise ConfigError(
            f"training.batch_size={b} is not divisible by training.gradient_accumulation_steps={g} x "
            f"data-parallel degree {dp} = {g * dp}, so no micro_batch_size fits"
        )
    return b // (g * dp), g
