"""Every other mount, through fsspec: ``s3://`` (s3fs; S3-compatible stores such as OBS, MinIO and
Ceph RGW through an endpoint URL) and anything else fsspec speaks.

Object stores have no rename and no fsync, so :attr:`atomic_rename` is False and :mod:`ckpt.commit`
uses the object-store protocol. A new file is one object: on S3 it goes up as a multipart upload
whose parts are sent in parallel while the writer produces the next ones (a small file is one PUT);
elsewhere through the filesystem's own stream. Either way ``close`` returns only after the upload
completed and the stored object's size equals the bytes written (buffered data silently dropped is
the failure this guards against). Reads are ranged requests, in parallel for large blobs.

Credentials come from ``storage_options`` or the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...) and stay inside the filesystem object: :meth:`display` and every error
message name the mount by ``scheme://path`` only.

The root's lock is a lease (:class:`~ckpt.storage.lease.LeaseLock`), built on S3's conditional PUTs
(:mod:`ckpt.storage.conditional`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from ..errors import CheckpointError, CorruptCheckpointError, StorageError
from . import conditional
from .base import Storage
from .lease import LeaseLock

log = logging.getLogger(__name__)

PART_BYTES = 32 << 20  # multipart part size (S3 allows 5 MiB .. 5 GiB)
PARALLEL_PARTS = 4  # parts in flight per file, which also bounds the writer's buffered bytes
RANGE_BYTES = 16 << 20  # one ranged GET


class FsspecStorage(Storage):
    is_local = False
    atomic_rename = False

    def __init__(self, fs, scheme: str):
        self.fs, self.scheme = fs, scheme
        self._is_s3 = "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self._conditional: tuple[bool, bool] | None = None  # conditional PUTs, DELETEs honoured (tried once)

    def display(self, path: str) -> str:
        return f"{self.scheme}://{path}"

    @contextmanager
    def _io(self, path: str, what: str):
        """Turn a backend failure into a StorageError naming the URL (never the options)."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            raise StorageError(f"{what} {self.display(path)} failed: {type(exc).__name__}: {_short(exc)}",
                               path=self.display(path)) from None

    def _fresh(self, path: str) -> None:
        self.fs.invalidate_cache(path)

    def list(self, path: str) -> list[str]:
        with self._io(path, "listing"):
            self._fresh(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
        prefix = path.rstrip("/") + "/"
        return sorted({e.rstrip("/")[len(prefix):].split("/", 1)[0] for e in entries if e.startswith(prefix)} - {""})

    # fsspec's isfile/isdir answer False on ANY error (s3fs swallows them): a server error would read
    # as "no manifest" and start-up clean-up would delete a committed step. info() raises instead.
    def _kind(self, path: str) -> str | None:
        with self._io(path, "checking"):
            self._fresh(path)
            try:
                return self.fs.info(path).get("type")
            except (FileNotFoundError, NotADirectoryError):
                return None

    def is_dir(self, path: str) -> bool:
        return self._kind(path) == "directory"

    def is_file(self, path: str) -> bool:
        return self._kind(path) == "file"

    def open_read(self, directory: str, name: str) -> "RemoteReader":
        path = self.join(directory, name)
        with self._io(path, "opening"):
            self._fresh(path)
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.display(directory)}: {name} is missing",
                                             path=self.display(directory), file=name) from None
        return RemoteReader(self, path, size)

    def makedirs(self, path: str) -> None:
        if self._is_s3:  # no directories on S3 (and s3fs would create a missing bucket)
            return
        with self._io(path, "creating"):
            self.fs.makedirs(path, exist_ok=True)

    def create(self, path: str):
        if self._is_s3:
            return S3PartsWriter(self, path)
        return StreamWriter(self, path)

    def write_bytes(self, path: str, data: bytes) -> None:
        handle = self.create(path)
        try:
            handle.write(data)
            handle.close()
        except BaseException:
            handle.abort()
            raise

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{self.scheme} has no atomic rename")

    def remove(self, path: str) -> None:
        with self._io(path, "deleting"):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            self._fresh(path)

    def remove_tree(self, path: str) -> None:
        with self._io(path, "deleting"):
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self._fresh(path)

    def lock(self, path: str, *, holder: str) -> "LeaseLock":
        return LeaseLock(self, path, holder)

    # conditional writes (the lease's compare-and-swap): on S3 only, where the store honours them
    def conditional_writes(self, directory: str) -> bool:
        return self._conditions(directory)[0]

    def conditional_deletes(self, directory: str) -> bool:
        return self._conditions(directory)[1]

    def _conditions(self, directory: str) -> tuple[bool, bool]:
        if self._conditional is None:
            self._conditional = conditional.honoured_conditions(self, directory) if self._is_s3 else (False, False)
        return self._conditional

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        return conditional.read_tagged(self, path, limit)

    def write_if(self, path: str, data: bytes, *, etag: str | None) -> str | None:
        return conditional.write_if(self, path, data, etag=etag)

    def delete_if(self, path: str, etag: str) -> bool:
        return conditional.delete_if(self, path, etag)

    def size(self, path: str) -> int:
        self._fresh(path)
        return self.fs.size(path)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:300]


class RemoteReader:
    def __init__(self, storage: FsspecStorage, path: str, size: int):
        self.storage, self.path, self.size = storage, path, size

    def read_into(self, buffer: memoryview, offset: int) -> int:
        view = memoryview(buffer).cast("B")
        end = min(offset + len(view), self.size)
        if end <= offset:
            return 0
        starts = range(offset, end, RANGE_BYTES)

        def fetch(start: int) -> int:
            stop = min(start + RANGE_BYTES, end)
            data = self.storage.fs.cat_file(self.path, start=start, end=stop)
            view[start - offset : start - offset + len(data)] = data
            return len(data)

        with self.storage._io(self.path, "reading"):
            if len(starts) == 1:
                got = [fetch(offset)]
            else:
                with ThreadPoolExecutor(min(PARALLEL_PARTS, len(starts)), thread_name_prefix="ckpt-get") as pool:
                    got = list(pool.map(fetch, starts))
        return sum(got)

    def close(self) -> None:
        pass


class _CheckedWriter:
    """Common end of an upload: compare the stored object's size with the bytes written."""

    storage: FsspecStorage
    path: str
    size: int

    def _check_size(self) -> None:
        stored = self.storage.size(self.path)
        if stored != self.size:
            raise StorageError(f"{self.storage.display(self.path)} holds {stored} bytes after upload, "
                               f"{self.size} were written", path=self.storage.display(self.path))


class StreamWriter(_CheckedWriter):
    """A file through the filesystem's own write stream (non-S3 fsspec mounts)."""

    def __init__(self, storage: FsspecStorage, path: str):
        self.storage, self.path, self.size = storage, path, 0
        with storage._io(path, "creating"):
            self.stream = storage.fs.open(path, "wb")

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        with self.storage._io(self.path, "writing"):
            self.stream.write(view)
        self.size += len(view)

    def close(self) -> int:
        with self.storage._io(self.path, "writing"):
            self.stream.close()
            self._check_size()
        return self.size

    def abort(self) -> None:
        try:
            self.stream.close()
        except Exception:
            pass
        try:
            self.storage.remove(self.path)
        except CheckpointError:
            log.warning("could not remove the aborted upload %s", self.storage.display(self.path))


class S3PartsWriter(_CheckedWriter):
    """One S3 object written as a multipart upload, :data:`PARALLEL_PARTS` parts in flight."""

    def __init__(self, storage: FsspecStorage, path: str, part_bytes: int = PART_BYTES):
        self.storage, self.path, self.size, self.part_bytes = storage, path, 0, part_bytes
        self.bucket, self.key, _ = storage.fs.split_path(path)
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list = []
        self.pool: ThreadPoolExecutor | None = None

    def _call(self, method: str, **kwargs):
        return self.storage.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while len(view):
            take = min(self.part_bytes - len(self.buffer), len(view))
            self.buffer += view[:take]
            view = view[take:]
            if len(self.buffer) >= self.part_bytes:
                self._send_part()

    def _send_part(self) -> None:
        with self.storage._io(self.path, "uploading"):
            if self.upload_id is None:
                self.upload_id = self._call("create_multipart_upload")["UploadId"]
                self.pool = ThreadPoolExecutor(PARALLEL_PARTS, thread_name_prefix="ckpt-put")
            in_flight = [f for f in self.parts if not f.done()]
            if len(in_flight) >= PARALLEL_PARTS:
                in_flight[0].result()
            number, body = len(self.parts) + 1, self.buffer  # handed over whole: no second copy
            self.buffer = bytearray()
            self.parts.append(self.pool.submit(self._upload_part, number, body))

    def _upload_part(self, number: int, body: bytearray) -> dict:
        out = self._call("upload_part", PartNumber=number, UploadId=self.upload_id, Body=body)
        return {"PartNumber": number, "ETag": out["ETag"]}

    def close(self) -> int:
        with self.storage._io(self.path, "uploading"):
            if self.upload_id is None:
                self._call("put_object", Body=self.buffer)
            else:
                if self.buffer:
                    self._send_part()
                parts = [f.result() for f in self.parts]
                self._call("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": parts})
                self.upload_id = None
                self.pool.shutdown()
            self.buffer = bytearray()
            self._check_size()
        return self.size

    def abort(self) -> None:
        self.buffer = bytearray()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.upload_id is not None:
            try:
                self._call("abort_multipart_upload", UploadId=self.upload_id)
            except Exception as exc:
                log.warning("could not abort the upload of %s (%s)", self.storage.display(self.path),
                            type(exc).__name__)
            self.upload_id = None
