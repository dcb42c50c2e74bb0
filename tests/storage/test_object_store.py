"""Checkpoints straight on an object store (a real S3-protocol server on loopback): the storage seam
(ckpt.storage.remote: multipart uploads, size checks), a manager on an S3 root, and credentials that
never leak. The object-store commit protocol is tested in tests/ckpt/commit/test_object_store.py, the
lease lock in test_lease.py."""

from __future__ import annotations

import logging

import pytest
import torch

import ckpt
from ckpt.format import MANIFEST_NAME
from ckpt.root import CheckpointRoot
from ckpt.storage import locate
from ckpt.storage.remote import S3PartsWriter
from tests.support.checkpoints import assert_state_equal, blank_state, make_state
from tests.support.s3server import TEST_KEY, TEST_SECRET
from tests.support.s3server import bucket_fs as _s3
from tests.support.s3server import bucket_objects as _objects


def test_save_and_load_straight_to_s3_bitwise(s3_bucket):
    url = f"{s3_bucket.url}/run/step-00000001"
    state = make_state(1)
    ckpt.save(state, url, storage_options=s3_bucket.storage_options)
    live = blank_state()
    manifest = ckpt.load(live, url, storage_options=s3_bucket.storage_options)
    assert_state_equal(live, state)
    assert manifest.step is None and ckpt.read_manifest(url, s3_bucket.storage_options).tensors.keys() == \
        manifest.tensors.keys()
    names = sorted(p.rsplit("/", 1)[-1] for p in _objects(s3_bucket, "run/step-00000001"))
    assert names[-1] == MANIFEST_NAME and all(".rank-00000" in n for n in names[:-1])  # attempt-tagged


def test_the_standard_aws_environment_variables_alone_are_enough(s3_bucket, aws_env):
    url = f"{s3_bucket.url}/env/step-1"
    state = make_state(2)
    ckpt.save(state, url)
    live = blank_state()
    ckpt.load(live, url)
    assert_state_equal(live, state)


def test_large_files_go_up_in_parallel_parts_and_their_size_is_checked(s3_bucket, monkeypatch):
    storage = locate(s3_bucket.url, s3_bucket.storage_options).storage
    payload = torch.randint(0, 255, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    writer = S3PartsWriter(storage, f"{s3_bucket.name}/big.bin", part_bytes=5 << 20)
    for start in range(0, len(payload), 3 << 20):
        writer.write(payload[start:start + (3 << 20)])
    assert writer.close() == len(payload) and len(writer.parts) == 3
    assert _s3(s3_bucket).cat_file(f"{s3_bucket.name}/big.bin") == payload

    # An object store that silently dropped buffered bytes: the size check refuses the file.
    monkeypatch.setattr(type(storage), "size", lambda self, path: 5)
    short = S3PartsWriter(storage, f"{s3_bucket.name}/short.bin")
    short.write(b"0123456789")
    with pytest.raises(ckpt.StorageError, match="holds 5 bytes after upload, 10 were written"):
        short.close()


def test_manager_on_an_s3_root_saves_retains_and_resumes(s3_bucket):
    root = f"{s3_bucket.url}/managed"
    states = [make_state(seed) for seed in range(4)]
    with ckpt.CheckpointManager(root, interval=1, keep=2, storage_options=s3_bucket.storage_options) as manager:
        for step, state in enumerate(states, start=1):
            manager.save(step, state)
    assert CheckpointRoot(root, s3_bucket.storage_options).steps() == [3, 4]
    with ckpt.CheckpointManager(root, storage_options=s3_bucket.storage_options) as manager:
        live = blank_state()
        assert manager.load(live) == 4
    assert_state_equal(live, states[3])


def test_credentials_never_reach_files_logs_or_errors(s3_bucket, caplog, tmp_path):
    caplog.set_level(logging.INFO)  # (botocore's own DEBUG lines show the access key id: AWS's choice)
    caplog.set_level(logging.DEBUG, logger="ckpt")
    root = f"{s3_bucket.url}/secret"
    for primary, replica in ((root, str(tmp_path / "replica")), (str(tmp_path / "local"), root)):
        with ckpt.CheckpointManager(primary, interval=1, keep=1, replicas=[replica],
                                    storage_options=s3_bucket.storage_options) as manager:
            manager.save(1, make_state(5))
            manager.save(2, make_state(6))
    assert (tmp_path / "local" / ".catalog" / "data.mdb").is_file()  # it indexes the S3 mount too
    with pytest.raises(ckpt.CheckpointNotFoundError) as missing:
        ckpt.load(blank_state(), f"{root}/step-00000009", storage_options=s3_bucket.storage_options)
    with pytest.raises(ckpt.CheckpointError) as refused:  # a bucket that does not exist
        ckpt.save(make_state(7), "s3://no-such-bucket-here/step-1", storage_options=s3_bucket.storage_options)
    written = b"".join(_objects(s3_bucket).values())
    written += b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    said = caplog.text + str(missing.value) + str(refused.value) + repr(refused.value)
    for secret in (TEST_KEY, TEST_SECRET):
        assert secret.encode() not in written and secret not in said


def test_a_merged_safetensors_file_straight_to_s3(s3_bucket):
    from safetensors.torch import load

    url = f"{s3_bucket.url}/export/model.safetensors"
    state = make_state(8)
    ckpt.save(state, url, merged=True, storage_options=s3_bucket.storage_options)
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(state, url, merged=True, storage_options=s3_bucket.storage_options)
    tensors = load(_s3(s3_bucket).cat_file(f"{s3_bucket.name}/export/model.safetensors"))
    assert all(torch.equal(tensors[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert list(_objects(s3_bucket, "export")) == [f"{s3_bucket.name}/export/model.safetensors"]


def test_a_manifest_put_retried_after_its_first_try_landed_still_commits(s3_bucket, monkeypatch):
    """The commit point is a conditional PUT (issue 36 item 4). When its first try lands and the
    answer is lost, the client's retry is refused by the PUT's own condition: the writer recognises
    its own manifest and the save succeeds (it must not abort: that would delete the objects its
    committed manifest references)."""
    from ckpt.storage.remote import FsspecStorage

    real = FsspecStorage.write_if

    def landed_then_retried(self, path, data, *, etag):
        if path.endswith(f"/{MANIFEST_NAME}"):
            real(self, path, data, etag=etag)  # the first try lands; its answer is lost
        return real(self, path, data, etag=etag)  # the retry

    monkeypatch.setattr(FsspecStorage, "write_if", landed_then_retried)
    url, state = f"{s3_bucket.url}/retried/step-00000001", make_state(3)
    ckpt.save(state, url, storage_options=s3_bucket.storage_options)
    live = blank_state()
    ckpt.load(live, url, storage_options=s3_bucket.storage_options)
    assert_state_equal(live, state)


def test_a_failure_after_the_commit_point_leaves_the_committed_step_whole(s3_bucket, monkeypatch):
    """Past the commit point nothing removes what the manifest references: a clean-up failure there
    (the replaced manifest's objects cannot be deleted) does not fail the save, and when something
    does fail after the manifest is committed, the save's abort keeps the objects it references."""
    from ckpt.commit import object_store

    url, options = f"{s3_bucket.url}/after-commit/step-00000001", s3_bucket.storage_options
    ckpt.save(make_state(4), url, storage_options=options)
    real_remove, real_finish = object_store._remove_replaced, object_store.ManifestLastCommit.finish

    def unreachable(target, files):
        raise ckpt.StorageError("deleting failed: the mount is unreachable")

    monkeypatch.setattr(object_store, "_remove_replaced", unreachable)
    ckpt.save(make_state(5), url, storage_options=options, overwrite=True)  # committed, not failed
    monkeypatch.setattr(object_store, "_remove_replaced", real_remove)

    def committed_then_failed(self, *args, **kwargs):
        real_finish(self, *args, **kwargs)
        raise ckpt.StorageError("the answer to the manifest PUT was lost")

    monkeypatch.setattr(object_store.ManifestLastCommit, "finish", committed_then_failed)
    with pytest.raises(ckpt.StorageError, match="answer to the manifest PUT was lost"):
        ckpt.save(make_state(6), url, storage_options=options, overwrite=True)
    live = blank_state()
    ckpt.load(live, url, storage_options=options)  # the committed step 6, whole
    assert_state_equal(live, make_state(6))
