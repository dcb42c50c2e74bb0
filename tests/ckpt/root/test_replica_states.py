"""ckpt.root.replica_states: one vocabulary from the replicator through the catalog to ``ckpt inspect``.

Every state the replicator reports (``on_state``, the manager's :class:`CatalogUpdates`) is kept by the
catalog as the same :class:`ReplicaState` member and shown by the listing as its value; a deleted step is
forgotten, not kept as a state; a manifest the rebuild cannot read is a ``failed`` state."""

from __future__ import annotations

import torch

import ckpt
from ckpt.inspect.report import step_rows
from ckpt.root.catalog import Catalog
from ckpt.root.catalog.updates import CatalogUpdates
from ckpt.root.replica_states import MISSING, ReplicaState
from ckpt.storage import locate

REPLICA = "s3://bucket/replica"


def test_every_state_the_replicator_reports_reaches_the_listing(tmp_path):
    primary = locate(tmp_path / "run")
    with Catalog(tmp_path / "cat") as catalog:
        catalog.set_mounts([primary, REPLICA])
        updates = CatalogUpdates(catalog)
        for step, state in enumerate(ReplicaState, 1):
            updates.replica_state(REPLICA, step, state, f"detail of {state}")
        infos = {info.step: info for info in catalog.steps()}
    deleted = list(ReplicaState).index(ReplicaState.DELETED) + 1
    assert deleted not in infos  # forgotten: no mount holds or is copying it
    assert {step: info.mounts[REPLICA].state for step, info in infos.items()} == {
        step: state for step, state in enumerate(ReplicaState, 1) if state is not ReplicaState.DELETED}
    assert all(type(info.mounts[REPLICA].state) is ReplicaState for info in infos.values())

    mounts = [(str(primary), primary), (REPLICA, locate("/nowhere"))]
    rows = step_rows(mounts, {str(primary): [], REPLICA: []}, infos)  # the mounts list nothing: in flight only
    in_flight = [s for s in ReplicaState if s not in (ReplicaState.COMMITTED, ReplicaState.DELETED)]
    assert [row["mounts"][REPLICA] for row in rows] == [state.value for state in in_flight]
    assert {row["mounts"][str(primary)] for row in rows} == {MISSING}


def test_a_rebuild_records_an_unreadable_manifest_as_failed(tmp_path):
    root = tmp_path / "run"
    with ckpt.CheckpointManager(root, interval=1) as manager:
        manager.save(1, {"w": torch.ones(3)})
    (root / "step-00000001" / "manifest.json").write_text("{not json")
    with Catalog(tmp_path / "cat") as catalog:
        catalog.rebuild([locate(root)])
        state = catalog.step(1).mounts[str(root)]
    assert state.state is ReplicaState.FAILED and state.detail.startswith("unreadable manifest: ")
