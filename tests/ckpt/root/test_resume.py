"""ckpt.root.resume: a load falls back to a replica (bitwise) when the primary's copy is bad, to the
previous step when no mount has a good copy, and takes a delta chain's links from different mounts."""

from __future__ import annotations

import shutil
import warnings

import pytest

import ckpt
from ckpt.root import CheckpointRoot
from ckpt.root.catalog.store import Catalog
from tests.support.checkpoints import assert_state_equal, step_path
from tests.support.replicas import FAST_RETRY
from tests.support.replicas import blank as _blank
from tests.support.replicas import train as _train


def test_load_falls_back_to_a_replica_bitwise_when_the_primary_copy_is_bad(tmp_path):
    primary, replica = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)], **FAST_RETRY) as manager:
        saved = _train(manager, [1, 2, 3])
    with Catalog(primary / ".catalog", readonly=True) as catalog:  # the manager's index of both mounts
        assert catalog.mounts() == [str(primary), str(replica)]
        assert [(i.step, i.kind, {m: s.state for m, s in i.mounts.items()}) for i in catalog.steps()] == \
            [(s, "full", {str(primary): "committed", str(replica): "committed"}) for s in (1, 2, 3)]
    data = step_path(primary, 3) / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))  # corrupt on the primary
    shutil.rmtree(step_path(primary, 2))  # and gone there
    with ckpt.CheckpointManager(primary, replicas=[str(replica)]) as manager:
        live = _blank()
        with pytest.warns(UserWarning, match="step 3 loaded from replica"):
            assert manager.load(live) == 3
        assert_state_equal(live, saved[3])
        live = _blank()
        with pytest.warns(UserWarning, match="loaded from replica"):
            assert manager.load(live, step=2) == 2
        assert_state_equal(live, saved[2])


def test_no_good_copy_anywhere_falls_back_to_the_previous_step(tmp_path):
    primary, replica = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)], **FAST_RETRY) as manager:
        saved = _train(manager, [1, 2])
    for root in (primary, replica):
        (step_path(root, 2) / "data" / "rank-00000.bin").write_bytes(b"garbage")
    with ckpt.CheckpointManager(primary, replicas=[str(replica)]) as manager:
        live = _blank()
        with pytest.warns(UserWarning, match="step 2 cannot be loaded"):
            assert manager.load(live) == 1
        assert_state_equal(live, saved[1])


def test_a_delta_chain_whose_links_live_on_different_mounts_loads_bitwise(tmp_path, s3_bucket):
    primary, s3 = tmp_path / "a", f"{s3_bucket.url}/chain"
    options = s3_bucket.storage_options
    with ckpt.CheckpointManager(primary, interval=1, keep=5, full_every=4, replicas=[s3],
                                storage_options=options, **FAST_RETRY) as manager:
        saved = _train(manager, [1, 2, 3])
    assert [ckpt.read_manifest(step_path(primary, s)).kind for s in (1, 2, 3)] == ["full", "delta", "delta"]
    replica = CheckpointRoot(s3, options)
    replica.delete(1)  # the full lives only on the primary
    shutil.rmtree(step_path(primary, 2))  # the middle link only on S3
    with ckpt.CheckpointManager(primary, replicas=[s3], storage_options=options, **FAST_RETRY) as manager:
        live = _blank()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # step 3 comes from the primary: no fallback warning
            assert manager.load(live) == 3  # link 2 from S3, link 1 from the primary
        assert_state_equal(live, saved[3])
