"""ckpt.root.resolve: which checkpoint an argument means — a committed directory, a root's newest step
that can load (a delta whose chain lost a link is passed over, as a resumed run would), a root's step
N — and the one-line refusals; the same resolver behind ckpt-merge, ckpt-inspect and the trainer's
checkpoint.initial_load_path."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckpt
from ckpt.root import CheckpointRoot, open_root, resolve_checkpoint
from ckpt.root import step_path as at
from tests.support.checkpoints import step_path


@pytest.fixture
def chain(tmp_path):
    """Steps 1-5 of one run: 1 full, 2-3 deltas, 4 full, 5 a delta on 4."""
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, full_every=3, keep=10) as manager:
        for step in range(1, 6):
            manager.save(step, {"w": torch.full((64,), float(step))})
    assert [ckpt.read_manifest(step_path(root, s)).kind for s in range(1, 6)] == \
        ["full", "delta", "delta", "full", "delta"]
    return root


def test_a_committed_checkpoint_is_itself(chain):
    assert resolve_checkpoint(step_path(chain, 2)) == at(chain, 2)
    assert resolve_checkpoint(str(step_path(chain, 2)), step=2) == at(chain, 2)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="is step 2, not step 3"):
        resolve_checkpoint(step_path(chain, 2), step=3)


def test_a_root_means_its_newest_step_or_the_one_asked_for(chain):
    assert resolve_checkpoint(chain) == at(chain, 5)
    assert resolve_checkpoint(chain, step=3) == at(chain, 3)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no committed step 9 under .*newest committed: 1, 2, 3, 4, 5"):
        resolve_checkpoint(chain, step=9)


def test_a_delta_whose_chain_lost_a_link_is_never_chosen(chain):
    """The newest committed step, 5, is a delta on 4; 4 lost its manifest: 5 cannot load, so the
    newest step is 3 (what a resumed run takes), and asking for 5 says why it cannot be had."""
    (step_path(chain, 4) / "manifest.json").unlink()
    assert CheckpointRoot(chain).committed()[-1] == 5
    assert resolve_checkpoint(chain) == at(chain, 3)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="step 5 under .* cannot be loaded: a link of its delta"):
        resolve_checkpoint(chain, step=5)
    shutil.rmtree(step_path(chain, 1))  # now every committed delta is an orphan
    (step_path(chain, 4)).rename(chain / "elsewhere")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no step under .* can be loaded"):
        resolve_checkpoint(chain)


def test_what_is_not_a_checkpoint_nor_a_root_is_refused_in_one_line(chain, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    (tmp_path / "empty" / "step-00000001").mkdir(parents=True)  # a step dir without manifest
    (chain / "step-00000007.tmp-0123456789ab").mkdir()
    for source, words in ((tmp_path / "absent", "no checkpoint root at"),
                          (tmp_path / "absent", "neither a checkpoint"),
                          (tmp_path / "plain", "neither a checkpoint (no manifest.json) nor a checkpoint root"),
                          (tmp_path / "empty", "holds no committed step"),
                          (step_path(chain, 9), "no checkpoint at"),
                          (chain / "step-00000007.tmp-0123456789ab", "leftover of an unfinished save")):
        with pytest.raises(ckpt.CheckpointNotFoundError) as info:
            resolve_checkpoint(source)
        assert words in str(info.value) and "\n" not in str(info.value), (source, str(info.value))


def test_open_root_is_the_root_an_argument_names(chain, tmp_path):
    root = open_root(chain)
    assert isinstance(root, CheckpointRoot) and root.steps() == [1, 2, 3, 4, 5]
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no checkpoint at"):
        open_root(step_path(chain, 9))
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no checkpoint root at"):
        open_root(tmp_path / "absent")
