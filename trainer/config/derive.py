"""What a configuration implies: the model's shapes and the batch split for a data-parallel degree.

Contract: both take the configuration's sections (any object with ``model``/``training`` sections:
a :class:`trainer.config.Config`, whose methods of the same names call these) and raise
:class:`ConfigError` naming the keys and spelling out the arithmetic when the values cannot work.
"""

from __future__ import annotations

from typing import Any

from .schema import ConfigError
from ..model import FLAVORS, ModelArgs
from ..model import model_args as flavor_args


def model_args(cfg: Any, tokenizer_vocab_size: int | None) -> ModelArgs:
    """The model's shapes: the flavor's, overridden by the explicit ``model.*`` values, the
    vocabulary the tokenizer's unless given, with room for ``training.seq_len`` positions.

    Raises ConfigError naming the keys when they cannot work: an unknown flavor, dimensions
    that do not divide, or ``model.vocab_size`` below ``tokenizer_vocab_size`` (None: not
    checked), whose token ids the embedding would not have.
    """
    m = cfg.model
    if m.flavor.lower() not in FLAVORS:
        raise ConfigError(f"model.flavor={m.flavor!r} is invalid: must be one of {', '.join(FLAVORS)}")
    if None not in (m.vocab_size, tokenizer_vocab_size) and m.vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: the tokenizer has {tokenizer_vocab_size} "
                          "tokens, so it must be at least that (or none for the tokenizer's)")
    given = {key: getattr(m, key) for key in ("hidden_dim", "n_layers", "n_heads", "n_kv_heads")
             if getattr(m, key) is not None}
    shape = {"dim" if key == "hidden_dim" else key: value for key, value in given.items()}
    try:
        return flavor_args(m.flavor, vocab_size=m.vocab_size or tokenizer_vocab_size, **shape,
                           max_seq_len=max(cfg.training.seq_len, FLAVORS[m.flavor.lower()].max_seq_len))
    except ValueError as e:
        named = "".join(f", model.{key}={value}" for key, value in given.items())
        raise ConfigError(f"model.flavor={m.flavor!r}{named} cannot work: {e}") from None


def resolve_batch(cfg: Any, dp_degree: int) -> tuple[int, int]:
    """(micro_batch_size, gradient_accumulation_steps) for a data-parallel degree.

    They satisfy ``batch_size == micro_batch_size * gradient_accumulation_steps * dp_degree``.
    Missing values are derived (accumulation defaults to 1); inconsistent or non-divisible
    combinations raise ConfigError with the arithmetic spelled out.
    """
    if isinstance(dp_degree, bool) or not isinstance(dp_degree, int) or dp_degree < 1:
        raise ConfigError(f"data-parallel degree must be a positive integer, not {dp_degree!r}")
    t = cfg.training
    b, m, g, dp = t.batch_size, t.micro_batch_size, t.gradient_accumulation_steps, dp_degree
    if m is not None and g is not None:
        if m * g * dp != b:
            raise ConfigError(
                f"training.batch_size={b} must equal training.micro_batch_size={m} x "
                f"training.gradient_accumulation_steps={g} x data-parallel degree {dp} = {m * g * dp}"
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
