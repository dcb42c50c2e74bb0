"""Every system the benchmarks compare ours with, each written once; the benchmarks only time them.

A peer here is the library calls that make one save (or load) of that system, exactly as the tables
describe them; what a benchmark measures around them (which part is stall, when a save counts as
durable, what is checked afterwards) stays in the benchmark. Optional peers (``torchsnapshot``,
``zipnn``) are imported when first used, so a benchmark that does not run them does not need them.

bare copy       :class:`BareCopy`: ``dst.copy_(src)`` of every tensor into buffers preallocated
                and faulted in (``fill_(0)``) at set-up — the limit of a copy not overlapped with
                compute.
raw             :class:`Raw`: ``os.write`` of every tensor's bytes back to back into one file +
                ``fsync``, and ``os.preadv`` of the whole file into one pre-faulted buffer — the
                limit of one writer / reader.
DCP async_save  :class:`DCPAsyncSave`: ``dcp.async_save(state, storage_writer=FileSystemWriter(dir),
                async_stager=...)`` with one save in flight (DCP's contract: the next call first
                waits for the previous upload); the stager by :data:`STAGERS`: ``default`` (None:
                the writer, a ``BlockingAsyncStager``, copies inside the call), ``caching``
                (``DefaultStager(StagingOptions(False, False, True, False))``: cached staging
                storages, copy on a background thread; the CPU-capable options) and ``pinned``
                (``StagingOptions(True, False, True, True)``, torchtitan's
                ``async_with_pinned_mem``; needs an accelerator).
DCP             :func:`dcp_save` / :func:`dcp_load`: ``dcp.save(state, storage_writer=
                FileSystemWriter(dir, sync_files=True))`` / ``dcp.load(state, storage_reader=
                FileSystemReader(dir))`` in place.
torch.save      :func:`torch_save` (``torch.save`` + ``fsync`` of the file) / :func:`torch_load_into`
                (``torch.load(mmap=False, weights_only=True)`` then ``copy_`` into the live tensors).
safetensors     :func:`safetensors_save` (``save_file`` + ``fsync``) / :func:`safetensors_load_into`.
torchsnapshot   :func:`snapshot_take` (``Snapshot.take`` + ``fsync`` of every file it wrote: it never
                fsyncs itself) / :func:`snapshot_restore` (``Snapshot(dir).restore``, in place), and
                :class:`SnapshotAsyncTake` (``Snapshot.async_take``, one in flight).
zipnn           :func:`zipnn_compress` / :func:`zipnn_decompress`: ``ZipNN(input_format="byte",
                bytearray_dtype="float32"|"bfloat16", threads=1)`` of one tensor's bytes, or its XOR
                delta against a base (``delta_compressed_type="byte"``); :func:`zipnn_missing` says
                why it cannot be imported, if it cannot.

The asynchronous peers tell when a save is done through ``on_done(perf_counter time)``, and their
``wait_previous`` returns the seconds it waited, so that every benchmark counts them alike.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from harness import fsync_path

IO_SLICE = 64 << 20  # bytes per os.write / os.preadv call of the raw peer


def torchsnapshot_module():
    """The torchsnapshot package, or None when it is not installed (an optional peer: the bench extra)."""
    try:
        import torchsnapshot
    except ImportError:
        return None
    return torchsnapshot


# ---------------------------------------------------------------------------------------------
# The limits: a bare copy and one raw writer / reader
# ---------------------------------------------------------------------------------------------
class BareCopy:
    """Buffers like ``tensors``, allocated and faulted in once; :meth:`copy` copies into them."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.dst = [torch.empty_like(t).fill_(0) for t in tensors]

    def copy(self, tensors: list[torch.Tensor]) -> None:
        for src, dst in zip(tensors, self.dst):
            dst.copy_(src)

    def close(self) -> None:
        self.dst = []


class Raw:
    """The physical limit: one sequential writer / reader on one file of a flat state's bytes."""

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffer.fill_(1)  # pre-fault, so the read pays no page faults the live state would not

    @staticmethod
    def save(state: dict, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in state.values():
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done : done + IO_SLICE])
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, state: dict, path: Path) -> None:
        view = memoryview(self.buffer.numpy())
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done : done + IO_SLICE]], done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        if done != len(view):
            raise RuntimeError(f"raw read: short read {done} of {len(view)}")

    def verify(self, reference: dict) -> None:
        offset = 0
        for key, t in reference.items():
            n = t.nbytes
            if not torch.equal(self.buffer[offset : offset + n], t.reshape(-1).view(torch.uint8)):
                raise RuntimeError(f"raw read: {key} differs")
            offset += n


# ---------------------------------------------------------------------------------------------
# DCP
# ---------------------------------------------------------------------------------------------
STAGERS = {
    "default": None,  # async_stager=None: FileSystemWriter stages (a fresh copy inside the call)
    "caching": StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                              use_non_blocking_copy=False),
    "pinned": StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                             use_non_blocking_copy=True),
}


class DCPAsyncSave:
    """``dcp.async_save`` with the stager ``STAGERS[stager]``, one save in flight.

    Per save: :meth:`wait_previous` (the previous upload; returns the seconds waited), :meth:`save`
    (returns the upload future; ``on_done(t)`` is told the ``perf_counter`` time the upload finished),
    :meth:`wait_staged` before the state changes (the caching/pinned stagers copy in the background);
    :meth:`drain` waits for everything, :meth:`close` closes the stager. ``returned`` collects the
    type names ``async_save`` answered with (``AsyncSaveResponse`` with a stager, else ``Future``)."""

    def __init__(self, stager: str = "default", process_group=None, no_dist: bool = True):
        options = STAGERS[stager]
        self.stager = None if options is None else DefaultStager(options)
        self.process_group, self.no_dist = process_group, no_dist
        self.upload: Future | None = None
        self.staging: Future | None = None
        self.returned: set[str] = set()

    def wait_previous(self) -> float:
        start = time.perf_counter()
        if self.upload is not None:
            self.upload.result()  # DCP's contract: the previous save must be finished
        return time.perf_counter() - start

    def save(self, state: dict, path: Path, on_done=None) -> Future:
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path), async_stager=self.stager,
                              process_group=self.process_group, no_dist=self.no_dist)
        if isinstance(resp, AsyncSaveResponse):
            self.returned.add("AsyncSaveResponse")
            self.staging, self.upload = resp.staging_completion, resp.upload_completion
        else:
            self.returned.add(type(resp).__name__)
            self.staging, self.upload = None, resp
        if on_done is not None:
            self.upload.add_done_callback(lambda _f: on_done(time.perf_counter()))
        return self.upload

    def wait_staged(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.wait_staged()
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def dcp_save(state: dict, path: Path, process_group=None, no_dist: bool = True) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True), process_group=process_group,
             no_dist=no_dist)


def dcp_load(state: dict, path: Path, process_group=None, no_dist: bool = True) -> None:
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=process_group, no_dist=no_dist)


# ---------------------------------------------------------------------------------------------
# Single files: torch.save, safetensors
# ---------------------------------------------------------------------------------------------
def torch_save(obj, path: Path) -> None:
    torch.save(obj, path)
    fsync_path(path)


def torch_load_into(state: dict, path: Path) -> None:
    loaded = torch.load(path, mmap=False, weights_only=True)
    for key, t in state.items():
        t.copy_(loaded[key])


def safetensors_save(state: dict, path: Path) -> None:
    safetensors.torch.save_file(state, path)
    fsync_path(path)


def safetensors_load_into(state: dict, path: Path) -> None:
    loaded = safetensors.torch.load_file(path)
    for key, t in state.items():
        t.copy_(loaded[key])


# ---------------------------------------------------------------------------------------------
# torchsnapshot
# ---------------------------------------------------------------------------------------------
def fix_torchsnapshot_bf16() -> None:
    """torchsnapshot 0.1.0 views a bf16 tensor's bytes through ``torch.empty(0).set_(untyped storage)``,
    a float32 tensor, so a bf16 tensor of odd length loses its last 2 bytes (``take`` then fails its
    own size check). Replace that one helper by a plain uint8 view of the same bytes: no copy either
    way, so the measured cost is unchanged."""
    from torchsnapshot import serialization

    def bytes_view(tensor: torch.Tensor) -> memoryview:
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("b")

    serialization._tensor_as_memoryview_via_untyped_storage = bytes_view


def snapshot_take(state: dict, path: Path) -> None:
    """``Snapshot.take`` of a flat state (``{"s": StateDict(**state)}``), then every file it wrote fsync'd."""
    import torchsnapshot

    fix_torchsnapshot_bf16()
    torchsnapshot.Snapshot.take(str(path), app_state={"s": torchsnapshot.StateDict(**state)})
    for file in path.rglob("*"):  # torchsnapshot closes its files without fsync; make it as durable as the others
        if file.is_file():
            fsync_path(file)


def snapshot_restore(state: dict, path: Path) -> None:
    """``Snapshot(dir).restore`` into the live tensors of a flat state (in place)."""
    import torchsnapshot

    torchsnapshot.Snapshot(str(path)).restore({"s": torchsnapshot.StateDict(**state)})


class SnapshotAsyncTake:
    """``Snapshot.async_take``, one in flight: :meth:`wait_previous` (returns the seconds waited) before
    :meth:`take`. It stages (a CPU copy of every tensor) inside the call and writes on the
    ``PendingSnapshot``'s thread; its file-system plug-in never fsyncs. ``PendingSnapshot`` has no
    callback: with ``on_done``, a watcher thread (it only blocks in ``join``) tells the
    ``perf_counter`` time that thread ended (its files and metadata written)."""

    def __init__(self):
        self.pending = None
        self.watchers: list[threading.Thread] = []

    def wait_previous(self) -> float:
        start = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
            self.pending = None  # what it holds may go before the next clones are made
        return time.perf_counter() - start

    def take(self, path: Path, app_state: dict, on_done=None):
        import torchsnapshot

        self.pending = torchsnapshot.Snapshot.async_take(str(path), app_state=app_state)
        if on_done is not None:
            watcher = threading.Thread(target=self._watch, args=(self.pending.thread, on_done), daemon=True)
            watcher.start()
            self.watchers.append(watcher)
        return self.pending

    @staticmethod
    def _watch(thread: threading.Thread, on_done) -> None:
        thread.join()
        on_done(time.perf_counter())

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.wait()
        for watcher in self.watchers:
            watcher.join()
        self.watchers.clear()


# ---------------------------------------------------------------------------------------------
# zipnn (reorders a float input's bits in place: it always gets a private copy)
# ---------------------------------------------------------------------------------------------
ZIPNN_DTYPE = {4: "float32", 2: "bfloat16"}  # element width -> zipnn's bytearray_dtype


def zipnn_missing() -> str | None:
    """Why zipnn cannot be imported (an optional peer: the bench extra), or None when it can."""
    try:
        import zipnn  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import leaves the peer out
        return (f"zipnn is not importable ({type(exc).__name__}: {exc}); `pip install zipnn` (or the bench extra) "
                "to include it")
    return None


def zipnn_codec(width: int, delta: bool = False):
    """One thread, bytes in, the dtype of ``width``-byte elements; with ``delta``, XOR against a base."""
    import zipnn

    extra = {"delta_compressed_type": "byte"} if delta else {}
    return zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPE[width], threads=1, **extra)


def zipnn_compress(data, width: int, base=None) -> bytes:
    """zipnn's output for ``data`` (a full tensor's bytes), or for its XOR delta against ``base``."""
    if base is None:
        return zipnn_codec(width).compress(bytearray(memoryview(data)))
    # the delta mode XORs into a new buffer first: the inputs stay as they are
    return zipnn_codec(width, delta=True).compress(memoryview(data), delta_second_data=memoryview(base))


def zipnn_decompress(stored, width: int, base=None) -> bytes:
    if base is None:
        return zipnn_codec(width).decompress(stored)
    return zipnn_codec(width, delta=True).decompress(stored, delta_second_data=memoryview(base))
