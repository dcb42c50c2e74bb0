"""One committed step copied to another mount, verified as it streams.

    copy_step(source, target)          one step, now (collective over ``group`` when given)

Contract of one copy (:func:`copy_step`):

1. Rank 0 reads the source manifest (its digest checked) and starts an attempt on the target with
   that mount's commit protocol (:mod:`ckpt.commit`). A target already committed with the source's
   manifest (the same bytes, so the same digest) is done and left as it is; one committed with
   another manifest (another history's step of that number, or a damaged one) is refused
   (:class:`TargetConflictError`, naming both digests: nothing committed is ever replaced by a copy;
   the replicator deletes its own stale copies first, :mod:`ckpt.root.replicate`). Anything there
   without a manifest (a killed copy or deletion) is replaced.
2. Every rank copies its share of the data files — the files a rank wrote (``rank-00003`` in the
   name; with another world size, rank index modulo world size) — streaming: every blob's xxh3-64
   is computed over the bytes as they pass and compared with the manifest before the file is
   finished, and a version-3 blob's block table, as copied, must be the table of those verified
   bytes, so corruption on the source is never committed on a replica. Each written file is
   finished durably and its size checked; with ``read_back=True`` every blob is then read back from
   the replica and verified (:func:`ckpt.read.source.verify_blobs`). ``progress(n)``, when given, is
   told each slice of ``n`` bytes as it is written (a tool's progress bar counts bytes, not steps).
3. Only when every rank succeeded does rank 0 write the manifest — the primary's bytes, unchanged —
   on the replica: the commit point. Otherwise — a failure on any rank or at the commit point, or an
   interrupt (Ctrl-C; ``ckpt-copy`` turns SIGTERM into one) — the attempt is removed before the error
   propagates: nothing half-written is left on the target.

A blob (or the manifest) that fails its checksum on the way is read again from the source: only a
source whose copy fails again raises :class:`SourceCorruptError` (copying it again cannot help); a
source that verifies the second time means the bytes were damaged in passing (a corrupted GET), a
:class:`~ckpt.errors.StorageError` like any other failure of the target or the network, worth a retry
(:mod:`ckpt.root.replicate`).
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from .. import commit
from ..collective import any_rank, broadcast_error, broadcast_value
from ..read.committed import read_manifest_bytes
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..format import Blob, Manifest, data_file_rank
from ..format.blocks import StreamDigest, pack
from ..format.digest import unseal
from ..read.source import DataFiles, verify_blobs
from ..storage import Location

SLICE = 16 << 20


class SourceCorruptError(CorruptCheckpointError):
    """The primary's copy of a step fails verification: copying it again cannot help (final)."""


class TargetConflictError(CheckpointError):
    """The target holds the step committed with another manifest than the source's: not a copy of it."""


def holds_copy(target: Location, raw: bytes, source: Location | str = "the source") -> bool:
    """Whether ``target`` holds the step whose manifest is ``raw`` committed: False when nothing is
    committed there; :class:`TargetConflictError` when another manifest is (or one that cannot be read)."""
    if not commit.is_committed(target):
        return False
    try:
        _, theirs = read_manifest_bytes(target)
    except CheckpointNotFoundError:
        return False  # deleted meanwhile
    except CorruptCheckpointError as exc:
        theirs, why = None, f"its manifest cannot be read: {' '.join(str(exc).split())}"
    if theirs == raw:
        return True
    if theirs is not None:
        why = f"manifest digest {unseal(theirs)[1] or 'none'}, the source's {unseal(raw)[1] or 'none'}"
    raise TargetConflictError(f"{target} is committed with another manifest than {source}'s ({why}): not a copy "
                              "of it (another history's step, or damaged); delete it there first to copy this one",
                              path=str(target))


def files_of_rank(manifest: Manifest, rank: int, world: int) -> list[str]:
    """The data files ``rank`` of ``world`` copies: those it wrote (by the rank in their name)."""
    mine = []
    for name in sorted(manifest.data_files()):
        owner = data_file_rank(name)
        if (0 if owner is None else owner) % world == rank:
            mine.append(name)
    return mine


def _blobs_by_file(manifest: Manifest) -> dict[str, list[tuple[str, Blob]]]:
    by_file: dict[str, dict[tuple[int, int], tuple[str, Blob]]] = {}
    for key, blob in manifest.blobs():
        by_file.setdefault(blob.file, {})[(blob.offset, blob.length)] = (key, blob)
    return {name: [blobs[k] for k in sorted(blobs)] for name, blobs in by_file.items()}


def copy_file(source: DataFiles, target: Location, name: str, blobs: list[tuple[str, Blob]],
              size: int | None = None, progress: Callable[[int], None] | None = None) -> int:
    """Stream the data file ``name`` (``size`` bytes, as its manifest records) from ``source`` to
    ``target/name``, verifying every blob as it passes; returns the bytes written. A mismatch
    aborts the file (nothing of it stays). ``progress(n)``: after each slice of ``n`` bytes written."""
    reader = source.open(name)
    if size is not None and reader.size != size:
        raise SourceCorruptError(f"{source.root}: {name} holds {reader.size} bytes, its manifest says {size}",
                                 path=str(source.root), file=name)
    out = target.storage.create((target / name).path)
    buffer = memoryview(bytearray(min(SLICE, max(reader.size, 1))))
    position = 0

    def move(end: int, hasher=None, kept: bytearray | None = None) -> None:
        nonlocal position
        while position < end:
            piece = buffer[: min(len(buffer), end - position)]
            if reader.read_into(piece, position) != len(piece):
                raise SourceCorruptError(f"{source.root}: {name} ended early at byte {position}",
                                         path=str(source.root), file=name)
            if hasher is not None:
                hasher.update(piece)
            if kept is not None:
                kept += piece
            out.write(piece)
            position += len(piece)
            if progress is not None:
                progress(len(piece))

    tables: dict[int, tuple[str, Blob, bytes]] = {}  # a version-3 blob's table as its bytes hashed
    try:
        for what, blob in blobs:
            if blob.offset < position or blob.offset + blob.length > reader.size:
                raise SourceCorruptError(f"{source.root}: {what} lies outside {name} or overlaps another blob",
                                         path=str(source.root), file=name, tensor=what)
            move(blob.offset)  # alignment padding
            hasher = StreamDigest(blob.block_size)  # per block for a version-3 blob
            move(blob.offset + blob.length, hasher)
            try:
                source.verify(blob, hasher.hexdigest(), what=what)
            except CorruptCheckpointError as exc:
                raise _mismatch(source, blob, what, exc) from None
            if blob.block_table is not None:
                tables[blob.block_table] = (what, blob, pack(hasher.blocks()))
        tail_start, tail = position, bytearray()  # after the last blob: the block tables, 8 bytes per MiB
        if tables:  # kept up to the last table's end only, whatever the file claims to hold after it
            move(max(tail_start, max(at + len(expected) for at, (_, _, expected) in tables.items())), kept=tail)
        move(reader.size)
        for at, (what, blob, expected) in tables.items():
            if bytes(tail[at - tail_start: at - tail_start + len(expected)]) != expected:
                raise _table_mismatch(source, blob, what)
        written = out.close()
    except BaseException:
        out.abort()
        raise
    if written != reader.size:
        raise StorageError(f"{target / name} holds {written} bytes, the source {reader.size}", path=str(target))
    return written


def _table_mismatch(source: DataFiles, blob: Blob, what: str) -> CheckpointError:
    """A block table whose copied bytes are not the table of the blob's verified bytes: final when
    the source's table fails its check too, else damaged in passing (see :func:`_mismatch`)."""
    fresh = DataFiles(source.root)
    try:
        fresh.block_table(blob, what=what)
    except CorruptCheckpointError as again:
        return SourceCorruptError(str(again), path=again.path, file=again.file, tensor=again.tensor)
    except (CheckpointError, OSError) as again:
        return StorageError(f"{what}'s block table cannot be read again now ({again})", path=str(source.root))
    finally:
        fresh.close()
    return StorageError(f"{what}'s block table was damaged in passing (the source verifies when read again), "
                        "copied again", path=str(source.root), file=blob.file)


def _mismatch(source: DataFiles, blob: Blob, what: str, exc: CorruptCheckpointError) -> CheckpointError:
    """A blob that failed its checksum on the way: read again from the source, it is final only when
    the source's copy fails too (:class:`SourceCorruptError`); otherwise the bytes were damaged in
    passing (a corrupted GET) and the copy is worth another try (a :class:`StorageError`)."""
    fresh = DataFiles(source.root)
    try:
        fresh.read(blob, what=what)
    except CorruptCheckpointError as again:
        return SourceCorruptError(str(again), path=again.path, file=again.file, tensor=again.tensor)
    except (CheckpointError, OSError) as again:  # the source unreachable now: worth another try
        return StorageError(f"{exc}; the source cannot be read again now ({again})", path=str(source.root))
    finally:
        fresh.close()
    return StorageError(f"{' '.join(str(exc).split())} while copying, but the source verifies when read again: "
                        "damaged in passing, copied again", path=str(source.root), file=blob.file)


def _source_manifest(source: Location) -> tuple[Manifest, bytes]:
    """The source's manifest; one that fails its digest is read once more (a corrupted GET) before
    the source counts as corrupt (final)."""
    try:
        return read_manifest_bytes(source)
    except CheckpointNotFoundError:
        raise
    except CorruptCheckpointError:
        try:
            return read_manifest_bytes(source)
        except CheckpointNotFoundError:
            raise
        except CorruptCheckpointError as exc:
            raise SourceCorruptError(str(exc), path=exc.path, file=exc.file) from None


def copy_step(source: Location, target: Location, *, read_back: bool = False, group=None,
              distributed: bool = False, fence: Callable[[], None] | None = None,
              progress: Callable[[int], None] | None = None) -> int:
    """Copy the committed checkpoint ``source`` to ``target`` (see the module docstring); returns the
    bytes this rank copied. Collective over ``group`` when ``distributed``. ``fence``: the target
    root's (:meth:`~ckpt.root.steps.CheckpointRoot.check_held`), checked before its commit point;
    ``progress(n)``: told the bytes of each slice this rank writes."""
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    plan, attempt, error = None, None, None
    if rank == 0:
        try:
            manifest, raw = _source_manifest(source)
            if holds_copy(target, raw, source):
                plan = "done"
            else:  # anything there without a manifest (a killed copy or deletion) is garbage: replaced
                attempt = commit.begin(target, overwrite=True)
                plan = (raw, attempt.directory.path)
        except Exception as exc:
            error = exc
    try:
        error = broadcast_error(error, group, distributed=distributed)
        if error is not None:
            raise error
        plan = broadcast_value(plan, group, distributed=distributed)
        if plan == "done":
            return 0
        return _copy_attempt(source, target, plan, attempt, rank, world, read_back=read_back, group=group,
                             distributed=distributed, fence=fence, progress=progress)
    except BaseException:  # also an interrupt (Ctrl-C, the CLI's SIGTERM): nothing half-written stays
        if attempt is not None:
            _discard(attempt, target)
        raise


def _discard(attempt, target: Location) -> None:
    """Rank 0: remove an attempt cut short, unless it passed its commit point (then it is the copy)."""
    try:
        if not commit.is_committed(target):
            commit.abort(attempt)
    except (CheckpointError, OSError):  # unreachable now: the next copy of the step removes it
        pass


def _copy_attempt(source: Location, target: Location, plan, attempt, rank: int, world: int, *, read_back: bool,
                  group, distributed: bool, fence, progress: Callable[[int], None] | None = None) -> int:
    """Every rank's share of the data files into the attempt, then rank 0's commit point (or abort)."""
    raw, directory = plan
    manifest = Manifest.from_json(raw, source=str(source))
    directory = Location(target.storage, directory)
    copied, local = 0, None
    try:
        mine = files_of_rank(manifest, rank, world)
        blobs = _blobs_by_file(manifest)
        files = DataFiles(source)
        try:
            for name in mine:
                copied += copy_file(files, directory, name, blobs.get(name, []), manifest.files.get(name),
                                    progress)
        finally:
            files.close()
        if read_back:
            verify_blobs(directory, manifest, files=mine)
    except Exception as exc:
        local = exc
    failed, corrupt = any_rank((local is not None, isinstance(local, SourceCorruptError)), group,
                               distributed=distributed)
    result = None
    if rank == 0:
        try:
            if failed:
                commit.abort(attempt)
            else:
                commit.finish(attempt, manifest, overwrite=True, raw=raw,  # replacing only what had no manifest
                              fence=fence)
        except Exception as exc:
            result = exc
    result = broadcast_error(result, group, distributed=distributed)  # every rank joins, its own error or not
    if local is not None:
        raise local
    if result is not None:
        raise result
    if corrupt:
        raise SourceCorruptError(f"{source} failed verification on another rank; not replicated", path=str(source))
    if failed:
        raise StorageError(f"copying {source} to {target} failed on another rank", path=str(target))
    return copied
