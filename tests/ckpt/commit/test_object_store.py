"""ckpt.commit.object_store (a real S3-protocol server on loopback): a prefix without a manifest does
not exist for readers, and a retry never mixes its objects with a dead attempt's."""

from __future__ import annotations

import pytest

import ckpt
from ckpt import commit
from ckpt.root import CheckpointRoot
from ckpt.storage import locate
from tests.support.checkpoints import assert_state_equal, blank_state, make_state
from tests.support.s3server import bucket_objects as _objects


def test_a_prefix_without_manifest_does_not_exist_and_a_retry_never_mixes_attempts(s3_bucket):
    options = s3_bucket.storage_options
    target = locate(f"{s3_bucket.url}/run/step-00000002", options)
    dead = commit.begin(target, overwrite=False)  # a save that died after writing its data
    target.storage.write_bytes((target / f"data/{dead.tag}.rank-00000.bin").path, b"half a checkpoint")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no manifest"):
        ckpt.read_manifest(target)
    assert CheckpointRoot(f"{s3_bucket.url}/run", options).steps() == []

    first, second = make_state(3), make_state(4)
    ckpt.save(first, str(target), storage_options=options)  # collects the dead attempt's object
    ckpt.save(second, str(target), storage_options=options, overwrite=True)
    data = [p for p in _objects(s3_bucket, "run/step-00000002") if "/data/" in p]
    referenced = {f.split("/", 1)[1] for f in ckpt.read_manifest(target).data_files()}
    assert len(data) == 1 and {p.rsplit("/", 1)[-1] for p in data} == referenced  # nothing of the others
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, second)
