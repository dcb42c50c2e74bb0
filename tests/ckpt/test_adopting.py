"""docs/ADOPTING.md, "A trainer that already calls DCP": the lines it shows, run on 2 gloo ranks — our
Writer and DoubleBufferStager under plain ``dcp.async_save`` on a gloo group of its own, a load through
our Reader with the strict SafeLoadPlanner (rank-local keys accepted), and the caveats it states: a
value every rank saves under one key is stored once, and a committed step is never written over."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
from tests.support.launch import run_ranks


def _dcp_trainer(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    checkpoint_pg = dist.new_group(backend="gloo")
    stager = ckpt.DoubleBufferStager()
    weight = torch.full((4, 4), float(rank))  # each rank's own tensor, under a rank-named key
    state = {f"weight_rank{rank}": weight, "shared": torch.arange(6.0), "same_key": torch.tensor([rank]),
             f"loader.dp_rank_{rank}": {"position": 10 + rank}}
    response = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(f"{root}/step-1"), async_stager=stager,
                              process_group=checkpoint_pg)
    stager.track(response.upload_completion)
    stager.wait_snapshot()                  # before the optimizer step: the live tensors may change now
    weight.add_(100.0)
    response.upload_completion.result()
    try:  # a committed step is never written over (a restarted trainer must resume, not save again)
        dcp.save(state, storage_writer=ckpt.dcp.Writer(f"{root}/step-1"), process_group=checkpoint_pg)
        exists = False
    except CheckpointException as exc:  # DCP's wrapper (a BaseException) around each rank's error
        exists = any(isinstance(error, ckpt.CheckpointExistsError) for error, _ in exc.failures.values())

    live = {f"weight_rank{rank}": torch.zeros(4, 4), "shared": torch.zeros(6), "same_key": torch.tensor([-1]),
            f"loader.dp_rank_{rank}": {"position": -1}}
    dcp.load(live, storage_reader=ckpt.dcp.Reader(f"{root}/step-1"), planner=ckpt.SafeLoadPlanner())
    stager.close()
    return {"weight": live[f"weight_rank{rank}"][0, 0].item(), "shared": torch.equal(live["shared"], torch.arange(6.0)),
            "same_key": live["same_key"].item(), "position": live[f"loader.dp_rank_{rank}"]["position"],
            "exists": exists}


@pytest.mark.slow
def test_a_dcp_calling_trainer_on_two_ranks(tmp_path):
    results = run_ranks(2, _dcp_trainer, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["weight"] == float(rank)          # the snapshot, not the tensor changed after it
        assert result["shared"] and result["position"] == 10 + rank
        assert result["exists"]
    same = [r["same_key"] for r in results]
    assert same[0] == same[1] and same[0] in (0, 1)     # one rank's copy of a per-rank value under one key
