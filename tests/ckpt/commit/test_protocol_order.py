"""The commit protocol's order, asserted on the recorded operations (issue 22, item 16a): a save, an
overwrite, a delta, a replication and a retention, on a local POSIX mount and on the loopback S3 server
(:mod:`tests.support.recording`, the sequences of :mod:`tests.support.protocol_scenarios`).

POSIX: a root the save creates fsync'd into its parent first (a crash cannot take a new root away with
its steps: found by the sweep, fixed); every data file written, fsync'd, its directory fsync'd, then
the manifest written and fsync'd, the attempt directory fsync'd, the rename (the commit point), the parent fsync'd; an overwrite moves
the old copy aside only once the new manifest is durable, and deletes it only after the rename is.
Object store: every data object completed before the manifest PUT (the commit point); an overwrite's
old objects deleted only after it. A replica's copy of a step commits after the primary's and in the
same order; a deletion (retention) removes the manifest first (fsync'd on POSIX), the rest after, and
only once a newer step is committed. The crash-point sweep over the same sequences is
tests/reliability/test_crash_points.py.
"""

from __future__ import annotations

import pytest

from ckpt.format import MANIFEST_NAME, step_name
from tests.support.protocol_scenarios import MUTANTS, ROOT, SCENARIOS, Where

KINDS = ("posix", "s3")


@pytest.fixture
def where(request, tmp_path):
    bucket = request.getfixturevalue("s3_bucket") if request.param == "s3" else None
    return Where(request.param, tmp_path, bucket)


def _seq(ops, kind, path=None, *, prefix=None, last=False, after=-1):
    hits = [op.seq for op in ops if op.kind == kind and op.seq > after
            and (path is None or op.path == path) and (prefix is None or op.path.startswith(prefix))]
    assert hits, f"no {kind} {path or prefix} after {after} in {ops}"
    return hits[-1] if last else hits[0]


def at(step: int) -> str:
    """A step's directory as recorded (relative to the directory above the root)."""
    return f"{ROOT}/{step_name(step)}"


def commit_point(mount, step: int) -> int:
    """The seq of the operation that committed ``step`` on ``mount``: the rename on POSIX, the
    manifest PUT on an object store."""
    ops, name = mount.recording.ops, at(step)
    if mount.object_store:
        return _seq(ops, "write_bytes", f"{name}/{MANIFEST_NAME}")
    return next(op.seq for op in ops if op.kind == "rename" and op.dst == name and ".tmp-" in op.path)


def assert_commit_order(mount, step: int) -> None:
    ops, name = mount.recording.ops, at(step)
    point = commit_point(mount, step)
    if mount.object_store:
        uploads = [op for op in ops if op.kind == "close" and op.path.startswith(f"{name}/data/") and op.seq < point]
        assert uploads, f"no data object of {name} before its manifest"
        removed_early = [op for op in ops if op.kind in ("remove", "remove_tree") and op.path.startswith(name)
                         and max(u.seq for u in uploads) < op.seq < point]
        assert not removed_early, f"{name}: deleted between its data and its manifest: {removed_early}"
        mine = {u.path for u in uploads}
        removed_after = [op.path for op in ops if op.kind == "remove" and op.seq > point and op.path in mine]
        assert not removed_after, f"{name}: its own objects deleted after its commit: {removed_after}"
        return
    rename = next(op for op in ops if op.seq == point)
    tmp = rename.path
    data_files = [op.path for op in ops if op.kind == "create" and op.path.startswith(f"{tmp}/data/")]
    assert data_files, f"no data file of {name}"
    synced_data = _seq(ops, "fsync_dir", f"{tmp}/data", last=True)
    for path in data_files:
        assert _seq(ops, "write", path, last=True) < _seq(ops, "fsync", path) < synced_data, path
    manifest = _seq(ops, "write_bytes", f"{tmp}/{MANIFEST_NAME}")
    manifest_synced = _seq(ops, "fsync", f"{tmp}/{MANIFEST_NAME}", after=manifest)
    tmp_synced = _seq(ops, "fsync_dir", tmp, after=manifest_synced)
    assert synced_data < manifest < manifest_synced < tmp_synced < point
    parent_synced = _seq(ops, "fsync_dir", ROOT, after=point)
    aside = [op for op in ops if op.kind == "rename" and op.path == name and op.seq < point]
    if aside:  # an overwrite: the old copy moved aside once the new one is durable, deleted after the commit
        assert tmp_synced < aside[-1].seq < point
        assert _seq(ops, "remove_tree", aside[-1].dst) > parent_synced
    between = [op for op in ops if op.kind in ("remove", "remove_tree") and op.path.startswith(name)
               and synced_data < op.seq < parent_synced]
    assert not between, f"{name}: deleted while committing: {between}"


def assert_deleted_manifest_first(mount, step: int, *, after: int) -> None:
    ops, name = mount.recording.ops, at(step)
    manifest = _seq(ops, "remove", f"{name}/{MANIFEST_NAME}")
    assert manifest > after, f"{name} deleted before the step that replaces it committed"
    rest = _seq(ops, "remove_tree", name, after=manifest)
    if not mount.object_store:
        assert manifest < _seq(ops, "fsync_dir", name, after=manifest) < rest


@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_a_save_writes_its_data_durably_then_the_manifest_then_commits(where):
    (mount,) = SCENARIOS["save"](where).mounts
    assert_commit_order(mount, 1)
    if not mount.object_store:  # the root it created lasts: its entry fsync'd before the commit
        ops = mount.recording.ops
        assert _seq(ops, "makedirs", prefix=ROOT) < _seq(ops, "fsync_dir", ".") < commit_point(mount, 1)
    assert mount.recording.verbs()[-1][0] == ("put" if mount.object_store else "fsync_dir")


@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_an_overwrite_replaces_the_old_copy_only_after_the_new_one_is_committed(where):
    (mount,) = SCENARIOS["overwrite"](where).mounts
    assert_commit_order(mount, 1)
    ops = mount.recording.ops
    point = commit_point(mount, 1)
    if mount.object_store:  # the old objects go after the PUT of the new manifest, never before
        old = [op for op in ops if op.kind == "remove" and op.path.startswith(f"{at(1)}/data/")]
        assert old and all(op.seq > point for op in old)
    else:
        assert any(op.kind == "rename" and op.path == at(1) for op in ops)  # moved aside, not deleted


@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_a_delta_commits_after_its_base_the_same_way(where):
    (mount,) = SCENARIOS["delta"](where).mounts
    for step in (1, 2):
        assert_commit_order(mount, step)
    assert commit_point(mount, 1) < commit_point(mount, 2)


@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_a_replica_commits_each_step_after_the_primary_data_before_manifest(where):
    primary, replica = SCENARIOS["replication"](where).mounts
    for step in (1, 2):
        assert_commit_order(primary, step)
        assert_commit_order(replica, step)
        assert commit_point(primary, step) < commit_point(replica, step)
    assert commit_point(replica, 1) < commit_point(replica, 2)


@pytest.mark.parametrize("where", KINDS, indirect=True)
def test_retention_deletes_the_manifest_first_and_only_after_a_newer_commit(where):
    (mount,) = SCENARIOS["retention"](where).mounts
    for step in (1, 2, 3):
        assert_commit_order(mount, step)
    for step in (1, 2):
        assert_deleted_manifest_first(mount, step, after=commit_point(mount, step + 1))
    assert not any(op.kind in ("remove", "remove_tree") and op.path.startswith(at(3))
                   for op in mount.recording.ops)


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_order_checks_catch_each_surviving_mutant_of_the_audit(mutant, monkeypatch, tmp_path, request):
    patch, scenario, kind = MUTANTS[mutant]
    where = Where(kind, tmp_path, request.getfixturevalue("s3_bucket") if kind == "s3" else None)
    with monkeypatch.context() as patched:
        patch(patched)
        run = SCENARIOS[scenario](where)
    with pytest.raises(AssertionError):
        for mount in run.mounts:
            for step in run.expected[mount.name]:
                assert_commit_order(mount, step)
