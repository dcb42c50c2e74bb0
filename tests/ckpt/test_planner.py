"""ckpt.read.planner: an incompatible live state fails with one error listing every problem, before a single
byte is read; strict=False tolerates missing and unexpected keys but never a shape or dtype mismatch.
Strict mode accepts state each rank saved for itself (a key some rank asks for) and refuses keys no
rank saved or no rank asks for."""

from __future__ import annotations

import pickle

import pytest
import torch

import ckpt
from tests.support.checkpoints import BIAS, WEIGHT
from tests.support.launch import run_ranks


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


def _rank_local(rank: int, world: int, path: str, asks: str) -> dict:
    """Each rank saves a shared weight and a value of its own under its own key; then each loads
    strictly what ``asks`` says it asks for."""
    import torch.distributed as dist

    ckpt.save({WEIGHT: torch.full((4, 4), 3.0), f"rank{rank}": {"position": 10 + rank}}, path)
    live = {WEIGHT: torch.zeros(4, 4), f"rank{rank}": {"position": -1}}
    if asks == "extra" and rank == 1:
        live["rank9"] = {"position": -1}           # nobody saved it: missing (on rank 1)
    if asks == "fewer" and rank == 1:
        del live["rank1"]                           # nobody asks for rank1's key any more: unexpected
    try:
        ckpt.load(live, path)
    except ckpt.IncompatibleCheckpointError as err:
        return {"missing": err.missing, "unexpected": err.unexpected, "mismatched": err.mismatched}
    finally:
        dist.barrier()
    return {"position": live[f"rank{rank}"]["position"], "weight": live[WEIGHT][0, 0].item()}


@pytest.mark.slow
def test_strict_load_accepts_state_each_rank_saved_for_itself(tmp_path):
    """torchtitan's dataloader.dp_rank_<r>: every key some rank asks for fits, strictly."""
    results = run_ranks(2, _rank_local, str(tmp_path / "ck"), "own")
    assert results == [{"position": 10, "weight": 3.0}, {"position": 11, "weight": 3.0}]


@pytest.mark.slow
@pytest.mark.parametrize("asks, missing, unexpected", [("extra", ["rank9"], []), ("fewer", [], ["rank1"])])
def test_strict_load_still_refuses_what_no_rank_fits(tmp_path, asks, missing, unexpected):
    """A key no rank saved, or one no rank asks for, is refused on every rank at once."""
    for result in run_ranks(2, _rank_local, str(tmp_path / "ck"), asks):
        assert result == {"missing": missing, "unexpected": unexpected, "mismatched": []}


def test_rank_local_state_of_a_larger_job_is_unexpected_alone(tmp_path):
    """One process loading what two ranks saved: the other rank's own key is asked for by no one."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from ckpt.read.planner import SafeLoadPlanner

    saved = Metadata(state_dict_metadata={"rank0": BytesStorageMetadata(), "rank1": BytesStorageMetadata()})
    planner = SafeLoadPlanner()
    planner.set_up_planner({"rank0": 1}, saved, True)
    with pytest.raises(ckpt.IncompatibleCheckpointError) as info:
        planner.create_global_plan([planner.create_local_plan()])
    assert (info.value.missing, info.value.unexpected) == ([], ["rank1"])
    lenient = SafeLoadPlanner(strict=False)
    lenient.set_up_planner({"rank0": 1}, saved, True)
    assert lenient.create_global_plan([lenient.create_local_plan()])[0].planner_data is None
