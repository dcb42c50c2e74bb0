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
from ckpt.format.blobs import checksum
from ckpt.format import seal
from tests.support.checkpoints import WEIGHT, Booby


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


def plant(path: Path, key: str, obj) -> None:
    """What a hostile author does: put a pickle of ``obj`` where value ``key``'s stream was, and
    fix up the manifest (length, checksum, file size) and its digest."""
    stream = io.BytesIO()
    torch.save(obj, stream)
    payload = stream.getvalue()
    manifest = path / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc.pop("digest")
    entry = doc["values"][key]
    data = path / entry["file"]
    offset = data.stat().st_size
    with open(data, "ab") as out:
        out.write(payload)
    entry.update(offset=offset, length=len(payload), checksum=checksum(payload))
    doc["files"][entry["file"]] = offset + len(payload)
    manifest.write_bytes(seal(doc))


def test_a_value_that_would_need_code_to_load_is_refused_at_save(run_dir, tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(ckpt.UnsafeCheckpointError, match="'hook' cannot be saved") as info:
        ckpt.save({WEIGHT: torch.randn(8, 8), "hook": Booby(marker)}, run_dir / "step-1")
    assert info.value.tensor == "hook" and not marker.exists()
    assert list(run_dir.iterdir()) == []  # nothing committed, no tmp dir left


def test_nested_values_json_cannot_hold_round_trip(run_dir):
    """A set or a complex number inside a dict (stored whole, through torch.save) loads back."""
    path = run_dir / "step-1"
    state = {WEIGHT: torch.randn(8, 8), "extra": {"seen": {3, 1, 4}, "z": 1 - 2j, "n": 5}}
    ckpt.save(state, path)
    assert ckpt.read_manifest(path).values["extra"].encoding == "torch_save"
    live = {WEIGHT: torch.zeros(8, 8), "extra": {}}
    ckpt.load(live, path)
    assert live["extra"] == {"seen": {3, 1, 4}, "z": 1 - 2j, "n": 5}


def test_code_in_a_value_never_runs(run_dir, tmp_path):
    marker = tmp_path / "pwned"
    path = run_dir / "step-1"
    ckpt.save({WEIGHT: torch.randn(8, 8), "hook": {1, 2}}, path)
    plant(path, "hook", Booby(marker))
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
