"""tools.prune, ckpt-prune: the manager's retention policy applied by hand — newest N kept, every
M-th kept, delta chains of kept steps kept, newest first, the root locked, the catalog told."""

from __future__ import annotations

import json

import ckpt
from tests.support.chains import load_mixed, train_with_chain
from tests.support.checkpoints import step_path
from tests.support.models import assert_same


def test_prune_keeps_the_chains_of_what_it_keeps(tmp_path, capsys):
    from tools.prune import main

    root = tmp_path / "run"
    expected = train_with_chain(root, steps=7, full_every=3)  # fulls 1, 4, 7; deltas 2-3 and 5-6, each on the one before
    assert main([str(root), "--keep", "2", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"root": str(root), "deleted": [1, 2, 3], "kept": [4, 5, 6, 7],
                                                   "dry_run": True}
    assert ckpt.CheckpointRoot(root).steps() == list(range(1, 8))  # a dry run deletes nothing
    assert main([str(root), "--keep", "2", "--keep-every", "3"]) == 0  # 6 keeps 5 and 4, 3 keeps 2 and 1
    assert capsys.readouterr().out.strip() == "deleted 0 step(s); kept 1, 2, 3, 4, 5, 6, 7"
    assert main([str(root), "--keep", "1"]) == 0
    assert capsys.readouterr().out.strip() == "deleted 6 step(s): 1, 2, 3, 4, 5, 6; kept 7"
    assert ckpt.CheckpointRoot(root).steps() == [7]
    assert_same(load_mixed(step_path(root, 7)), expected[7])


def test_prune_tells_the_catalog_and_refuses_a_running_root(tmp_path, capsys):
    from ckpt.root import open_catalog
    from tools.prune import main

    root = tmp_path / "run"
    train_with_chain(root, steps=3)  # the manager keeps a catalog in ROOT/.catalog
    assert main([str(root), "--keep", "1"]) == 0
    capsys.readouterr()
    with open_catalog(root / ".catalog", [ckpt.CheckpointRoot(root).path]) as catalog:
        assert [info.step for info in catalog.steps()] == [3]
    with ckpt.CheckpointManager(root):
        assert main([str(root), "--keep", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ckpt-prune: error:") and "lock" in err.lower()


def test_prune_rejects_a_keep_below_one(tmp_path, capsys):
    import pytest

    from tools.prune import main

    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), "--keep", "0"])
    assert exit_.value.code == 2
