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


def test_force_hint_only_where_force_would_help():
    """ "pass --force" only for an output that merely exists on a tool with --force not given; the
    library's "overwrite=True" never reaches a user; other refusals keep the library's words."""
    from ckpt import CheckpointExistsError
    from tools.cli import error_line

    exists = CheckpointExistsError("out/x already exists; pass overwrite=True to replace it", path="out/x")
    assert error_line("t", exists, forced=False) == "t: error: out/x already exists; pass --force to replace it"
    assert error_line("t", exists, forced=True) == "t: error: out/x already exists"
    assert error_line("t", exists) == "t: error: out/x already exists"  # a tool without --force
    other = CheckpointExistsError("root holds other checkpoints (steps 2, 4); choose an empty DST", path="root")
    for forced in (False, True, None):
        line = error_line("t", other, forced=forced)
        assert "holds other checkpoints" in line and "--force" not in line
