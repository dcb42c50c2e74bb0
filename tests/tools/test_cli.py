"""tools.cli: what the CLIs share — sizes as --max-shard-size takes them."""

from __future__ import annotations

import pytest

from tools.cli import parse_size


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5k") == 1500 and parse_size("123") == 123
    for bad in ("", "5XB", "GiB", "0", "-1GB"):
        with pytest.raises(Exception):
            parse_size(bad)
