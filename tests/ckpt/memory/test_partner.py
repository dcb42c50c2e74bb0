"""Partner copies (ckpt/memory/partner.py): the partner mapping, a hostile file table refused, and real
gloo ranks copying each other's committed checkpoints (written with ``no_dist=True``): every copy
loads bitwise, a byte damaged in passing or on the sender's disk is refused with nothing left at
the target, and a sender that fails (no checkpoint, a missing file, a read failing mid-file)
releases its receiver, each failure named on both sides. Pieces are made small (1000 bytes) in the
ranks so that every file travels in many of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.memory.nodes import node_of, partner_rank, source_rank
from ckpt.memory.partner import check_table
from tests.support.checkpoints import DATA_FILE, assert_state_equal, blank_state, flip_byte, make_state
from tests.support.launch import run_ranks

HANG_SECONDS = 60.0  # a guard against a peer left waiting, far above the few seconds these ranks take


# -- the mapping ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world, local, partners", [
    (4, 2, [2, 3, 0, 1]),              # 2 nodes of 2: the same local rank on the other node
    (3, 1, [1, 2, 0]),                 # 3 nodes: a ring
    (6, 2, [2, 3, 4, 5, 0, 1]),        # 3 nodes of 2
    (8, 2, [4, 5, 6, 7, 0, 1, 2, 3]),  # 4 nodes: the opposite half
])
def test_partner_is_the_same_local_rank_on_the_partner_node(world, local, partners):
    assert [partner_rank(r, world, local) for r in range(world)] == partners
    assert [source_rank(partners[r], world, local) for r in range(world)] == list(range(world))
    assert all(node_of(r, local) != node_of(partners[r], local) for r in range(world))


def test_one_node_has_no_partner():
    assert [partner_rank(r, 4, 4) for r in range(4)] == [None] * 4
    assert [source_rank(r, 4, 4) for r in range(4)] == [None] * 4


@pytest.mark.parametrize("local", [3, 0, -1])
def test_ranks_per_node_must_divide_the_world(local):
    with pytest.raises(ckpt.InvalidOptionError):
        partner_rank(0, 4, local)
    with pytest.raises(ckpt.InvalidOptionError):
        source_rank(0, 4, local)


# -- the file table -------------------------------------------------------------------------------
GOOD = [["manifest.json", 5], ["data/rank-00000.bin", 10], ["data/rank-00000-p1.bin", 0]]


def test_a_good_table_is_taken():
    assert check_table(GOOD) == [(name, size) for name, size in GOOD]


@pytest.mark.parametrize("table", [
    [["manifest.json", 5], ["../rank-00000.bin", 1]],
    [["manifest.json", 5], ["data/../../etc.bin", 1]],
    [["manifest.json", 5], ["/etc/passwd", 1]],
    [["manifest.json", 5], ["data/sub/rank-00000.bin", 1]],
    [["manifest.json", 5], ["data/rank-00000.bin", 1], ["data/rank-00000.bin", 1]],  # a repeat
    [["data/rank-00000.bin", 1], ["manifest.json", 5]],                               # manifest not first
    [["manifest.json", 5], ["manifest.json", 5]],                                     # the manifest twice
    [["data/rank-00000.bin", 1]],                                                       # no manifest
    [["manifest.json", 5], ["data/rank-00000.bin", -1]],
    [["manifest.json", 5], ["data/rank-00000.bin", 1 << 51]],
    [["manifest.json", 1 << 31], ["data/rank-00000.bin", 1]],
    [["manifest.json", 5], ["data/rank-00000.bin", True]],
    [],
    {"data/rank-00000.bin": 1},
])
def test_a_hostile_table_is_refused(table):
    with pytest.raises(ckpt.CorruptCheckpointError):
        check_table(table)


# -- real ranks -----------------------------------------------------------------------------------
def _swap_ranks(rank: int, world: int, tmp: str, local: int, damage: str | None):
    """Save this rank's state, copy it to its partner while taking its source's copy, load that copy.
    ``damage``: ``"mixed"`` makes rank 0 flip a byte of its first data piece as it sends it and
    rank 1 a byte of its stored data file; ``"fail"`` makes rank 0's data file missing, rank 1 have
    no checkpoint and rank 2's read fail after its first piece; ``"committed"``: each rank writes its
    state as the memory tier does and hands the manifest it committed to the send, which must not
    read it back."""
    import torch.distributed as dist

    from ckpt.memory import partner
    from ckpt.storage import locate

    partner.PIECE_BYTES = 1000
    own, copy = Path(tmp, f"own-{rank}"), Path(tmp, f"copy-{rank}", "rank")
    committed = None
    if damage == "committed":
        from ckpt.memory.local import flat_local, write_local

        committed = write_local(*flat_local(make_state(rank)), locate(own), step=1, run=None, user={})
        partner.read_manifest_bytes = _refused
    else:
        ckpt.save(make_state(rank), own, no_dist=True)
    to, source = partner_rank(rank, world, local), source_rank(rank, world, local)
    send = locate(own)
    if damage == "mixed" and rank == 0:
        _damage_first_piece_sent()
    elif damage == "mixed" and rank == 1:
        flip_byte(own)
    elif damage == "fail" and rank == 0:
        os.remove(own / DATA_FILE)
    elif damage == "fail" and rank == 1:
        send = None
    elif damage == "fail" and rank == 2:
        _fail_reads_after_one_piece()
    group = dist.new_group(backend="gloo")
    try:
        partner.swap(send, to, locate(copy), source, group, committed=committed)
    except (ckpt.CheckpointError, OSError) as exc:  # the tier takes both
        return type(exc).__name__, str(exc), getattr(exc, "__notes__", []), sorted(os.listdir(copy.parent))
    state = blank_state()
    ckpt.load(state, copy, no_dist=True)
    assert_state_equal(state, make_state(source))
    return "loaded", sorted(os.listdir(copy.parent))


def _refused(location):
    raise AssertionError(f"{location}'s manifest read back: the writer's own was handed over")


def _damage_first_piece_sent() -> None:
    """torch.distributed.isend flips a byte of the first data piece (the first uint8 tensor after
    the manifest's END frame: the file table and the manifest go first)."""
    import torch.distributed as dist

    from ckpt.memory.partner import END

    real, ends, flipped = dist.isend, [], []

    def isend(tensor, *args, **kwargs):
        if tensor.dtype == torch.int64 and tensor.numel() == 2 and int(tensor[0]) == END:
            ends.append(tensor)
        elif tensor.dtype == torch.uint8 and len(ends) == 1 and not flipped:
            flipped.append(tensor)
            tensor = tensor.clone()
            tensor[len(tensor) // 2] ^= 0xFF
        return real(tensor, *args, **kwargs)

    dist.isend = isend


def _fail_reads_after_one_piece() -> None:
    from ckpt.read import DataFiles

    real = DataFiles.open

    class Failing:
        def __init__(self, handle):
            self.handle, self.size, self.reads = handle, handle.size, 0

        def read_into(self, buffer, offset):
            self.reads += 1
            if self.reads > 1:
                raise OSError("the disk went away")
            return self.handle.read_into(buffer, offset)

        def close(self):
            self.handle.close()

    DataFiles.open = lambda self, name: Failing(real(self, name))


@pytest.mark.parametrize("world, local", [(4, 2), (3, 1)])
def test_ranks_swap_copies_that_load_bitwise(tmp_path, world, local):
    results = run_ranks(world, _swap_ranks, str(tmp_path), local, None, hang_seconds=HANG_SECONDS)
    assert results == [("loaded", ["rank"])] * world


def test_a_sender_handed_the_manifest_it_committed_sends_it_without_reading_it_back(tmp_path):
    """The memory tier's send: the manifest write_local just committed (and its bytes) go as they
    are, not read back and parsed again; the copies load bitwise."""
    results = run_ranks(2, _swap_ranks, str(tmp_path), 1, "committed", hang_seconds=HANG_SECONDS)
    assert results == [("loaded", ["rank"])] * 2


def test_damage_in_passing_or_on_the_senders_disk_is_refused_and_nothing_stays(tmp_path):
    results = run_ranks(2, _swap_ranks, str(tmp_path), 1, "mixed", hang_seconds=HANG_SECONDS)
    (kind0, text0, _, left0), (kind1, text1, _, left1) = results
    # rank 1 received rank 0's piece flipped in passing: the file's xxh3-64 is not the one sent
    assert kind1 == "CorruptCheckpointError" and "differs from what it read" in text1, text1
    assert "rank 0" in text1 and DATA_FILE in text1
    # rank 0 received rank 1's bytes as stored, damaged there: the blobs do not verify
    assert kind0 == "CorruptCheckpointError" and "does not verify" in text0 and "rank 1" in text0, text0
    assert DATA_FILE in text0
    assert left0 == left1 == []  # no committed copy, no attempt left behind


def test_a_failing_sender_releases_its_receiver_and_both_say_so(tmp_path):
    results = run_ranks(3, _swap_ranks, str(tmp_path), 1, "fail", hang_seconds=HANG_SECONDS)
    (kind0, text0, notes0, left0), (kind1, text1, notes1, left1), (kind2, text2, notes2, left2) = results
    assert DATA_FILE in text0 and kind0 != "SenderFailedError"  # rank 0's own error: its missing file
    assert "no checkpoint to send" in text1                     # rank 1 had nothing to send
    assert "the disk went away" in text2                        # rank 2's read failed mid-file
    # each receiver (the sender's error first, the receiver's as a note) names the rank that failed
    assert notes0 == [f"also: SenderFailedError: rank 2 failed while sending {DATA_FILE} (its own error says why)"]
    assert notes1 == ["also: SenderFailedError: rank 0 could not send its checkpoint (its own error says why)"]
    assert notes2 == ["also: SenderFailedError: rank 1 could not send its checkpoint (its own error says why)"]
    assert left0 == left1 == left2 == []
