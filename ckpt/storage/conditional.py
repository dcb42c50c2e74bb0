"""Conditional writes on S3: one small object replaced only while it is still the version a writer
last saw (an ETag compare-and-swap) — what the object-store lease (:mod:`ckpt.storage.lease`) is
built on, so that of two writers racing for it exactly one succeeds, however the two are scheduled.

* :func:`read_tagged`: the object's bytes and its ETag in one GET (None when it is missing; no bytes
  when it is larger than the caller's limit).
* :func:`write_if`: a PUT with ``If-None-Match: *`` (``etag=None``: only while the object does not
  exist) or ``If-Match: <etag>`` (only while it is still that version); the new ETag, or None when
  the store refused the condition (412 PreconditionFailed; 409 ConditionalRequestConflict, S3's
  answer to a concurrent conditional write; 404 for an If-Match on a deleted object). A PUT retried
  after its first try landed is refused the same way: callers read the object back and recognise
  their own record.
* :func:`delete_if`: a DELETE with ``If-Match: <etag>``; False when the condition failed.
* :func:`honoured_conditions`: whether the store enforces the conditions on PUT, and If-Match on
  DELETE, tried on a scratch object beside the lock (created with If-None-Match, created again,
  replaced with a wrong If-Match, deleted with a wrong If-Match: the last three must be refused;
  then deleted). A store that ignores the headers (stores or deletes anyway) or rejects them (501
  NotImplemented) does not: a lease cannot be exclusive there without the PUT conditions, and
  without the DELETE one a lease is released by a released record rather than by a delete.

Every other failure raises :class:`~ckpt.errors.StorageError` naming the object, never the options.
"""

from __future__ import annotations

import errno
import uuid

from fsspec.asyn import sync

READ_TRIES = 3
_CONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409", "404")


def read_tagged(storage, path: str, limit: int) -> tuple[bytes, str] | None:
    """``(bytes, etag)`` of the object at ``path``; None when it is missing; ``b""`` past ``limit``."""
    fs = storage.fs
    bucket, key, _ = fs.split_path(path)

    async def get():
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        try:
            if response.get("ContentLength", 0) > limit:  # not a record this engine wrote
                return b"", response["ETag"]
            return await response["Body"].read(), response["ETag"]
        finally:
            response["Body"].close()

    with storage._io(path, "reading"):
        for attempt in range(READ_TRIES):  # a GET is idempotent: a body cut short is read again
            try:
                return sync(fs.loop, get)
            except FileNotFoundError:
                return None
            except Exception:
                if attempt == READ_TRIES - 1:
                    raise


def write_if(storage, path: str, data: bytes, *, etag: str | None) -> str | None:
    """PUT ``data`` only while the object is the version ``etag`` (None: only while it is absent);
    the new ETag, or None when the condition failed (see the module docstring)."""
    with storage._io(path, "writing"):
        return _put_if(storage, path, data, etag)


def delete_if(storage, path: str, etag: str) -> bool:
    """DELETE the object only while it is the version ``etag``; False when the condition failed."""
    with storage._io(path, "deleting"):
        try:
            storage.fs.call_s3("delete_object", IfMatch=etag, **_where(storage, path))
        except Exception as exc:
            if _refused(exc):
                return False
            raise
        storage._fresh(path)
        return True


def honoured_conditions(storage, directory: str) -> tuple[bool, bool]:
    """Whether the store enforces (If-None-Match and If-Match on PUT, If-Match on DELETE): see the
    module docstring."""
    probe = storage.join(directory, f".lock-probe-{uuid.uuid4().hex}")
    wrong = '"0123456789abcdef0123456789abcdef"'
    with storage._io(probe, "trying a conditional write on"):
        try:
            if _put_if(storage, probe, b"probe", None) is None:
                return False, False
            if _put_if(storage, probe, b"again", None) is not None:
                return False, False  # If-None-Match ignored
            if _put_if(storage, probe, b"other", wrong) is not None:
                return False, False  # If-Match ignored
            return True, _delete_refused(storage, probe, wrong)
        except Exception as exc:
            if _not_implemented(exc):
                return False, False
            raise
        finally:
            storage.fs.call_s3("delete_object", **_where(storage, probe))


def _delete_refused(storage, probe: str, wrong: str) -> bool:
    """Whether a DELETE of ``probe`` with a wrong If-Match is refused (and the object stays)."""
    try:
        storage.fs.call_s3("delete_object", IfMatch=wrong, **_where(storage, probe))
    except Exception as exc:
        if _not_implemented(exc):
            return False
        if _refused(exc):
            return True
        raise
    return False  # deleted anyway: the condition ignored


def _not_implemented(exc: BaseException) -> bool:
    return _answer(exc)[1] == "501" or getattr(exc, "errno", None) == errno.ENOSYS


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, (FileExistsError, FileNotFoundError)) or any(
        part in _CONDITION_FAILED for part in _answer(exc))  # s3fs turns a 412 into FileExistsError


def _where(storage, path: str) -> dict:
    bucket, key, _ = storage.fs.split_path(path)
    return {"Bucket": bucket, "Key": key}


def _put_if(storage, path: str, data: bytes, etag: str | None) -> str | None:
    condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
    try:
        return storage.fs.call_s3("put_object", Body=data, **_where(storage, path), **condition)["ETag"]
    except Exception as exc:
        if _refused(exc):
            return None
        raise


def _answer(exc: BaseException) -> tuple[str, str]:
    """The S3 error code and HTTP status behind an exception s3fs raised ('' where none)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    response = getattr(cause, "response", None) or {}
    return (str(response.get("Error", {}).get("Code", "")),
            str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")))
