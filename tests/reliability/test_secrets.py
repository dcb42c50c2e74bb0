"""Credentials in URLs never land on disk or in a line (issue 22, item 5).

A careless user puts the key and secret into a mount URL (``s3://KEY:SECRET@bucket/run``) or a
signed query string (``?X-Amz-Security-Token=...``). The run works (userinfo is the mount's
credentials) and nothing it writes or prints holds them: config.json, metrics.jsonl, every
manifest.json, the catalog, the objects on S3 (their names and bodies), stdout, stderr, the
engine's log records, warnings, and the CLIs' lines (ckpt-inspect, ckpt-replay). A mount URL with a
query string is refused (its text would become part of every object name); the refusal's line
names the URL redacted. Real S3 protocol: moto on loopback (tests/support/s3server.py).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from ckpt.root import CheckpointRoot
from tests.support.s3server import bucket_objects
from tests.support.trainer_runs import trainer_args

URL_KEY = "urlkeyAKIA0000LEAKCHECK"
URL_SECRET = "url/secret+NEVER-WRITE-0123"  # a "/" and a "+", as real AWS secrets have
TOKEN = "tokenNEVERWRITE987"
SECRETS = (URL_KEY, "NEVER-WRITE", TOKEN)


def _leaks(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        return [s for s in SECRETS if s.encode() in text]
    return [s for s in SECRETS if s in text]


def test_redact_removes_userinfo_and_query_values():
    from ckpt.redact import redact

    assert redact(f"s3://{URL_KEY}:{URL_SECRET}@bucket/run") == "s3://bucket/run"
    assert redact("s3://KEY@bucket/run") == "s3://bucket/run"
    assert redact(f"copying to 's3://{URL_KEY}:{URL_SECRET}@b/r' failed") == "copying to 's3://b/r' failed"
    assert redact(f"s3://b/r?X-Amz-Security-Token={TOKEN}&x=1") == "s3://b/r?X-Amz-Security-Token=REDACTED&x=REDACTED"
    assert redact("s3://bucket/run@v2/step-00000001") == "s3://bucket/run@v2/step-00000001"  # '@' in a path
    assert redact("/local/path:with@signs") == "/local/path:with@signs"  # not a URL
    assert redact(redact(f"s3://{URL_KEY}:{URL_SECRET}@b/r")) == "s3://b/r"


def test_redact_cleans_every_url_of_a_message_not_only_the_first():
    """Issue 36 (mutation audit): a copy failure names its source and its target; a redact that
    cleaned only the first URL of a message would print the second one's credentials."""
    from ckpt.redact import redact

    message = (f"copying s3://{URL_KEY}:{URL_SECRET}@src/run/step-00000003 to "
               f"s3://{URL_KEY}2:{URL_SECRET}2@dst/run/step-00000003 failed")
    assert redact(message) == "copying s3://src/run/step-00000003 to s3://dst/run/step-00000003 failed"
    signed = f"s3://a/x?X-Amz-Security-Token={TOKEN} then s3://b/y?X-Amz-Signature={TOKEN}2&v=1"
    assert redact(signed) == "s3://a/x?X-Amz-Security-Token=REDACTED then s3://b/y?X-Amz-Signature=REDACTED&v=REDACTED"
    mixed = f"'s3://{URL_KEY}@a/x?t={TOKEN}' and 'gs://{URL_KEY}:{URL_SECRET}@b/y?t={TOKEN}'"
    assert redact(mixed) == "'s3://a/x?t=REDACTED' and 'gs://b/y?t=REDACTED'"
    assert not _leaks(redact(message + " " + signed + " " + mixed))


@pytest.mark.slow
def test_credentials_in_mount_urls_never_land_on_disk_or_in_a_line(s3_bucket, aws_env, tmp_path, capsys, caplog):
    from tools.inspection import main as inspect
    from tools.replay import main as replay
    from trainer.train import main as train

    caplog.set_level(logging.DEBUG, logger="ckpt")
    replica = f"s3://{URL_KEY}:{URL_SECRET}@{s3_bucket.name}/run"
    said, codes = [], []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        # a working run: the replica's credentials are its userinfo
        codes.append(train(trainer_args(str(tmp_path / "job"), steps=4, checkpoint__enable="true",
                                        checkpoint__interval=2, checkpoint__replicas=replica)))
        primary = tmp_path / "job" / "checkpoints"
        for argv in ([primary, "--mount", replica], [primary, "--mount", replica, "--json"],
                     [primary, "--mount", replica, "--verify", "--quiet"], [primary, "--rebuild-catalog",
                                                                           "--mount", replica]):
            codes.append(inspect([str(a) for a in argv]))
        codes.append(replay([str(primary), "--step", "4", "--quiet", "--out",
                             f"s3://{URL_KEY}:{URL_SECRET}@{s3_bucket.name}/replayed/step-00000004"]))
        # a working run whose primary (checkpoint.folder) carries the credentials
        codes.append(train(trainer_args(str(tmp_path / "job2"), steps=2, checkpoint__enable="true",
                                        checkpoint__interval=2,
                                        checkpoint__folder=f"s3://{URL_KEY}:{URL_SECRET}@{s3_bucket.name}/job2")))
        out = capsys.readouterr()
        said += [out.out, out.err]
        # refusals: a bucket that does not exist, a query string in the folder's URL
        for folder in (f"s3://{URL_KEY}:{URL_SECRET}@no-such-bucket-{s3_bucket.name}/run",
                       f"{s3_bucket.url}/queried?X-Amz-Security-Token={TOKEN}"):
            codes.append(train(trainer_args(str(tmp_path / "refused"), steps=2, checkpoint__enable="true",
                                            checkpoint__folder=folder)))
            out = capsys.readouterr()
            said += [out.out, out.err]
            assert out.err.count("\n") == 1 and out.err.startswith("error: checkpoint.folder="), out.err
    assert codes == [0, 0, 0, 0, 0, 0, 0, 2, 2], said
    assert CheckpointRoot(f"{s3_bucket.url}/run", s3_bucket.storage_options).steps() == [2, 4]
    assert CheckpointRoot(f"{s3_bucket.url}/job2", s3_bucket.storage_options).steps() == [2]
    assert f"{s3_bucket.url}/run" in said[0]  # the mount is named, redacted
    said += [record.getMessage() for record in caplog.records] + [str(w.message) for w in warned]
    assert [line for text in said for line in text.splitlines() if _leaks(line)] == []
    written = {str(path): path.read_bytes() for path in Path(tmp_path).rglob("*") if path.is_file()}
    assert any(name.endswith("config.json") for name in written) and any("data.mdb" in n for n in written)
    assert any(name.endswith("manifest.json") for name in written)
    stored = bucket_objects(s3_bucket)
    assert any(name.endswith("replayed/step-00000004/manifest.json") for name in stored)
    written.update({f"s3 object {name}": name.encode() + b"\n" + body for name, body in stored.items()})
    assert [(name, _leaks(body)) for name, body in written.items() if _leaks(body)] == [], [
        line for body in written.values() for line in body.splitlines() if _leaks(line)][:5]


def test_locate_takes_userinfo_as_credentials_and_refuses_a_query():
    from ckpt.errors import CheckpointError, StorageError
    from ckpt.root.catalog.store import mount_id
    from ckpt.storage import locate

    location = locate(f"s3://{URL_KEY}:{URL_SECRET}@bucket/run")
    assert str(location) == "s3://bucket/run" and location.path == "bucket/run"
    assert (location.storage.fs.key, location.storage.fs.secret) == (URL_KEY, URL_SECRET)
    with pytest.raises(StorageError) as info:
        locate(f"s3://bucket/run?X-Amz-Security-Token={TOKEN}")
    assert not _leaks(str(info.value)) and not _leaks(info.value.path) and "query string" in str(info.value)
    error = CheckpointError(f"reading s3://{URL_KEY}:{URL_SECRET}@b/r failed", path=f"s3://{URL_KEY}:{URL_SECRET}@b/r")
    assert str(error) == "reading s3://b/r failed" and error.path == "s3://b/r"
    assert mount_id(f"s3://{URL_KEY}:{URL_SECRET}@bucket/run/") == "s3://bucket/run"
