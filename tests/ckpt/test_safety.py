"""Non-JSON values are torch.save streams that load without ever running code: through ckpt.load
(SafeLoadPlanner) and through plain dcp.load with our Reader (which refuses first)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
from tests.ckpt.checkpoints import WEIGHT


class Booby:
    """Pickles as ``open(marker, "w")``: unpickling it with weights_only=False creates the marker."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_set_value_is_torch_save_and_round_trips(run_dir):
    path = run_dir / "step-1"
    state = {WEIGHT: torch.randn(8, 8), "seen": {3, 1, 4, 15, 9}}
    ckpt.save(state, path)
    doc = json.loads((path / "manifest.json").read_bytes())
    assert doc["values"]["seen"]["encoding"] == "torch_save"
    assert ckpt.read_manifest(path).values["seen"].encoding == "torch_save"

    live = {WEIGHT: torch.zeros(8, 8), "seen": None}
    ckpt.load(live, path)
    assert live["seen"] == {3, 1, 4, 15, 9}
    assert torch.equal(live[WEIGHT], state[WEIGHT])

    # plain DCP (DefaultLoadPlanner, torch.load(weights_only=False)) gets a safe re-serialised copy
    flat = {WEIGHT: torch.zeros(8, 8), "seen": None}
    dcp.load(flat, storage_reader=ckpt.dcp.Reader(path))
    assert flat["seen"] == {3, 1, 4, 15, 9}
    assert torch.equal(flat[WEIGHT], state[WEIGHT])


def test_code_in_a_value_never_runs(run_dir, tmp_path):
    marker = tmp_path / "pwned"
    path = run_dir / "step-1"
    ckpt.save({WEIGHT: torch.randn(8, 8), "hook": Booby(marker)}, path)
    assert not marker.exists()
    entry = ckpt.read_manifest(path).values["hook"]
    assert entry.encoding == "torch_save"

    live = {WEIGHT: torch.zeros(8, 8), "hook": None}
    with pytest.raises(ckpt.UnsafeCheckpointError) as info:
        ckpt.load(live, path)
    assert "hook" in str(info.value)
    assert not marker.exists()
    assert live["hook"] is None

    # Plain DCP with its DefaultLoadPlanner would torch.load(weights_only=False) whatever stream the
    # reader hands over; our reader must refuse first.
    flat = {WEIGHT: torch.zeros(8, 8), "hook": None}
    with pytest.raises((ckpt.UnsafeCheckpointError, CheckpointException)) as info:
        dcp.load(flat, storage_reader=ckpt.dcp.Reader(path))
    if isinstance(info.value, CheckpointException):
        failures = [pair[0] for pair in info.value.failures.values()]
        assert any(isinstance(f, ckpt.UnsafeCheckpointError) for f in failures), failures
    assert not marker.exists()
    assert flat["hook"] is None

    # The payload is armed: unpickling the stored bytes unsafely does create the marker.
    raw = (path / entry.blob.file).read_bytes()[entry.blob.offset : entry.blob.offset + entry.blob.length]
    handle = torch.load(io.BytesIO(raw), weights_only=False)
    handle.close()
    assert marker.exists()
