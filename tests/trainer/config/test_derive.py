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
