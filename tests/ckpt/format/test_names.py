"""ckpt.format.names: every name a checkpoint's directories and files get, and its parser, agree (what
one makes the other reads back), and the parsers take nothing else."""

from __future__ import annotations

import pytest

from ckpt.format import names


def test_step_names_round_trip_and_nothing_else_parses():
    assert names.step_name(7) == "step-00000007" and names.step_name(123456789) == "step-123456789"
    for step in (0, 7, 10**8, 2**40):
        assert names.parse_step_name(names.step_name(step)) == step
    for other in ("step-6", "step-0000000x", "step-00000007.tmp-0123456789ab", "xstep-00000007", "notes.txt", ""):
        assert names.parse_step_name(other) is None


def test_leftovers_name_their_target():
    step = names.step_name(5)
    tmp, old = names.attempt_name(step, "0123456789ab"), names.aside_name(step, "ba9876543210")
    assert tmp == "step-00000005.tmp-0123456789ab" and old == "step-00000005.old-ba9876543210"
    assert names.is_leftover(tmp) and names.is_leftover(old) and not names.is_leftover(step)
    assert names.leftover_target(tmp) == names.leftover_target(old) == step
    assert names.leftover_target(step) is None
    assert names.step_of_entry(tmp) == names.step_of_entry(old) == names.step_of_entry(step) == 5
    assert names.step_of_entry("notes.txt") is None and names.step_of_entry("model.bin.tmp-1") is None


@pytest.mark.parametrize("rank, part, tag, name", [
    (0, 0, "", "data/rank-00000.bin"),
    (3, 1, "", "data/rank-00003-p1.bin"),
    (3, 0, "3f9c1a2b4d5e", "data/3f9c1a2b4d5e.rank-00003.bin"),
    (123456, 2, "3f9c1a2b4d5e", "data/3f9c1a2b4d5e.rank-123456-p2.bin"),
])
def test_data_file_names_round_trip(rank, part, tag, name):
    assert names.data_file_name(rank, part, tag) == name
    assert names.is_data_file_name(name) and names.data_file_rank(name) == rank


def test_numbered_files_and_foreign_names():
    name = names.numbered_file_name(2, "3f9c1a2b4d5e")
    assert name == "data/3f9c1a2b4d5e.file-00002.bin" and names.is_data_file_name(name)
    assert names.data_file_rank(name) is None  # not a rank's: rank 0 copies it (ckpt.root.copy)


@pytest.mark.parametrize("bad", ["../../outside.bin", "/etc/passwd", "data/../../x.bin", "data/.hidden.bin",
                                 "data/a/b.bin", "data/x.txt", "rank-00000.bin", 3, None])
def test_hostile_data_file_names_are_not_names(bad):
    assert not names.is_data_file_name(bad)


def test_sibling_names_are_one_component():
    assert names.is_sibling_name(names.step_name(4)) and names.is_sibling_name("base.v2")
    for bad in ("..", "../step-00000004", "a/b", "/abs", "", ".hidden", "x" * 201, None, 4):
        assert not names.is_sibling_name(bad)
