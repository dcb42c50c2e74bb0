"""ckpt.retention: which steps a policy deletes, and retention keeping every base a retained delta needs."""

from __future__ import annotations

import torch

from ckpt import retention
from ckpt.manager import CheckpointManager, committed_steps
from tests.ckpt.chains import train_with_chain as _train_with_chain


def test_retention_keeps_what_retained_deltas_need(tmp_path):
    assert retention.steps_to_delete([1, 2, 3, 4, 5], keep=1, bases={2: 1, 3: 2, 4: None, 5: 4}) == [1, 2, 3]
    assert retention.steps_to_delete([1, 2, 3], keep=1, bases={2: 1, 3: 2}) == []
    _train_with_chain(tmp_path, steps=6, full_every=3)  # 1 full, 2-3 deltas, 4 full, 5-6 deltas
    with CheckpointManager(tmp_path, keep=1) as manager:
        manager.save(7, {"x": torch.ones(1)}, force=True)  # a full of another layout triggers retention
    assert committed_steps(tmp_path) == [7]
    _train_with_chain(tmp_path / "b", steps=5, full_every=3, keep=1)
    assert committed_steps(tmp_path / "b") == [4, 5]  # 5 is a delta on 4
