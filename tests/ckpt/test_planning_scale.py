"""Planning linear in the world size, shown without a clock: one rank's load planned against
synthetic manifests of many ranks (tests/support/big_manifest.py, no processes).

* the local plan tests one saved chunk per local chunk in a same-layout load, whatever the world
  size (DCP's sweep keeps every saved chunk that starts before the local one ends: for column
  shards, all of them), and exactly the overlapping ones in a resharded load;
* its read items are DCP's;
* each rank's compatibility report is as long as its own state, not as the manifest (rank-local
  keys of 2,048 ranks: the coordinator unions 2,048 one-key reports instead of intersecting 2,048
  lists of 2,047 keys).
"""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from ckpt.errors import IncompatibleCheckpointError
from ckpt.read.planner import SafeLoadPlanner
from tests.support.big_manifest import rank_state, sharded_manifest

TENSORS = 4


def _items(plan: LoadPlan) -> list:
    return sorted((i.dest_index.fqn, tuple(i.dest_index.offset), tuple(i.storage_index.offset),
                   tuple(i.storage_offsets), tuple(i.dest_offsets), tuple(i.lengths)) for i in plan.items)


def _plan(planner, manifest, rank, world, layout):
    planner.set_up_planner(rank_state(manifest, rank, world, layout), manifest.to_dcp_metadata(), False)
    return planner.create_local_plan()


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_same_layout_plan_tests_one_saved_chunk_per_local_chunk(layout):
    for world in (64, 2048):
        manifest = sharded_manifest(world, layout, tensors=TENSORS)
        for rank in (0, world // 2, world - 1):
            ours = SafeLoadPlanner()
            plan = _plan(ours, manifest, rank, world, layout)
            assert ours.plan_checks == TENSORS  # independent of the world size
            assert _items(plan) == _items(_plan(DefaultLoadPlanner(), manifest, rank, world, layout))


def test_resharded_plan_tests_only_what_overlaps():
    manifest = sharded_manifest(1024, "rows", tensors=TENSORS)  # saved by 1,024 ranks
    ours = SafeLoadPlanner()
    plan = _plan(ours, manifest, 7, 256, "rows")  # loaded by 256: 4 saved chunks per local one
    assert len(plan.items) == 4 * TENSORS
    assert ours.plan_checks <= 5 * TENSORS  # the overlapping ones, plus at most the neighbour below
    assert _items(plan) == _items(_plan(DefaultLoadPlanner(), manifest, 7, 256, "rows"))
    columns = SafeLoadPlanner()  # rows saved, columns loaded: every saved chunk overlaps
    plan = _plan(columns, sharded_manifest(64, "rows", tensors=TENSORS), 3, 16, "columns")
    assert len(plan.items) == columns.plan_checks == 64 * TENSORS


def test_reports_grow_with_the_rank_state_not_the_world():
    world = 2048
    manifest = sharded_manifest(world, "rows", tensors=1)
    metadata = manifest.to_dcp_metadata()
    for r in range(world):  # rank-local values, one per saving rank (torchtitan's dataloader.dp_rank_<r>)
        metadata.state_dict_metadata[f"dataloader.dp_rank_{r}"] = BytesStorageMetadata()
    plans = []
    for rank in range(world):
        planner = SafeLoadPlanner()
        state = {**rank_state(manifest, rank, world), f"dataloader.dp_rank_{rank}": rank}
        planner.set_up_planner(state, metadata, rank == 0)
        plans.append(planner.create_local_plan())
        assert len(plans[-1].planner_data.asked) == 2  # its own keys, not the 2,047 others
    coordinator = SafeLoadPlanner()
    coordinator.set_up_planner(rank_state(manifest, 0, world), metadata, True)
    assert len(coordinator.create_global_plan(plans)) == world
    metadata.state_dict_metadata["removed.module"] = BytesStorageMetadata()  # nobody asks: refused
    with pytest.raises(IncompatibleCheckpointError) as caught:
        coordinator.create_global_plan(plans)
    assert caught.value.unexpected == ["removed.module"]
