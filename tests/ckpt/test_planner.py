"""ckpt.planner: an incompatible live state fails with one error listing every problem, before a single
byte is read; strict=False tolerates missing and unexpected keys but never a shape or dtype mismatch."""

from __future__ import annotations

import pickle

import pytest
import torch

import ckpt
from tests.support.checkpoints import BIAS, WEIGHT


def test_incompatible_state_lists_every_problem(saved):
    path, _ = saved
    live = {
        WEIGHT: torch.full((64, 32), 7.0),                       # shape mismatch
        BIAS: torch.full((300,), 7.0, dtype=torch.float64),      # dtype mismatch
        "head.weight": torch.full((4,), 7.0),                    # missing from the checkpoint
        # "step" left out: unexpected in the checkpoint
    }
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(ckpt.IncompatibleCheckpointError) as info:
        ckpt.load(live, path)
    err = info.value
    assert err.missing == ["head.weight"]
    assert err.unexpected == ["step"]
    mismatched = {key: (saved_desc, live_desc) for key, saved_desc, live_desc in err.mismatched}
    assert sorted(mismatched) == [BIAS, WEIGHT]
    assert "64, 64" in mismatched[WEIGHT][0] and "64, 32" in mismatched[WEIGHT][1]
    assert "float32" in mismatched[BIAS][0] and "float64" in mismatched[BIAS][1]
    message = str(err)
    for needle in ("head.weight", "step", WEIGHT, BIAS, "64, 32", "float64"):
        assert needle in message, needle
    for key, value in before.items():  # checked before a single byte is read
        assert torch.equal(live[key], value)

    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ckpt.IncompatibleCheckpointError
    assert (clone.missing, clone.unexpected, clone.mismatched) == (err.missing, err.unexpected, err.mismatched)
    assert str(clone) == str(err)


def test_non_strict_tolerates_missing_and_unexpected_keys(saved):
    path, state = saved
    live = {WEIGHT: torch.full((64, 64), 7.0), "head.weight": torch.full((4,), 7.0)}
    ckpt.load(live, path, strict=False)
    assert torch.equal(live[WEIGHT], state[WEIGHT])
    assert torch.equal(live["head.weight"], torch.full((4,), 7.0))
    assert set(live) == {WEIGHT, "head.weight"}


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_non_strict_still_refuses_shape_and_dtype(saved, bad):
    path, _ = saved
    wrong = torch.full((64, 32), 7.0) if bad == "shape" else torch.full((64, 64), 7.0, dtype=torch.bfloat16)
    live = {WEIGHT: wrong, "head.weight": torch.zeros(4)}
    before = wrong.clone()
    with pytest.raises(ckpt.IncompatibleCheckpointError) as info:
        ckpt.load(live, path, strict=False)
    assert [m[0] for m in info.value.mismatched] == [WEIGHT]
    assert info.value.missing == [] and info.value.unexpected == []
    assert torch.equal(live[WEIGHT], before)
