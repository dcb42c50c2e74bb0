"""The five sequences of the commit protocol, recorded on one kind of mount each: a save, an overwrite, a
delta, a replication and a retention (issue 22, item 16), with what each may leave and the four
mutants of the mutation audit that survived the suite before.

    run = SCENARIOS["overwrite"](where)       # where: a Where (a local directory or an S3 bucket)
    run.mounts, run.expected, run.final       # for tests.support.crash_sweep.sweep

A :class:`Where` names the kind of mount (``"posix"``: a local directory; ``"s3"``: a prefix of a
bucket on the loopback moto server) and makes roots on it. Each scenario takes the model of its
mounts, records the sequence (every operation on every mount, one order), and returns a
:class:`Run`. The states are tiny (a 8x4 and a 4-element tensor): a sweep reads every crash state.

:data:`MUTANTS` are the audit's survivors as monkeypatches (each a one-line change of order or a lost
fsync), with the scenario and mount kind that shows each: the sweep must fail with each applied.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ckpt
from ckpt.format import MANIFEST_NAME, step_name
from tests.support.crash_sweep import Mount
from tests.support.recording import recording

ROOT = "run"  # the checkpoint root, below the directory (prefix) a scenario records


def content(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(4, generator=gen), "step": seed}


@dataclass
class Where:
    kind: str            # "posix" or "s3"
    tmp: Path
    bucket: object = None

    def root(self, name: str) -> tuple[str, str]:
        """(the root the engine is given, what the recording watches: the directory or prefix above
        it) for a new root under ``name``; the root itself does not exist yet (the engine creates it)."""
        if self.kind == "posix":
            path = self.tmp / name
            path.mkdir(parents=True, exist_ok=True)
            return str(path / ROOT), str(path)
        prefix = f"{name}-{uuid.uuid4().hex[:8]}"
        return f"{self.bucket.url}/{prefix}/{ROOT}", f"{self.bucket.name}/{prefix}"

    @property
    def options(self) -> dict | None:
        return None if self.bucket is None else self.bucket.storage_options

    def mount(self, watched: str, name: str = "primary") -> Mount:
        if self.kind == "posix":
            return Mount.local(Path(watched), name, root=ROOT)
        return Mount.s3(self.bucket, watched.split("/", 1)[1], name, root=ROOT)

    def recording(self, watched: str):
        return recording(watched, scheme="file" if self.kind == "posix" else "s3")


@dataclass
class Run:
    mounts: list[Mount]
    expected: dict[str, dict[int, list[dict]]]
    final: dict[str, set[int]] = field(default_factory=dict)


def _manager(root: str, where: Where, **options):
    options = {"interval": 1, "catalog": "", "async_mode": "sync", **options}
    return ckpt.CheckpointManager(root, storage_options=where.options, **options)


def save(where: Where) -> Run:
    root, watched = where.root("save")
    mount = where.mount(watched)
    with where.recording(watched) as rec:
        ckpt.save(content(1), f"{root}/{step_name(1)}", storage_options=where.options)
    return Run([mount.recorded(rec)], {"primary": {1: [content(1)]}}, {"primary": {1}})


def overwrite(where: Where) -> Run:
    root, watched = where.root("overwrite")
    ckpt.save(content(0), f"{root}/{step_name(1)}", storage_options=where.options)
    mount = where.mount(watched)
    with where.recording(watched) as rec:
        ckpt.save(content(1), f"{root}/{step_name(1)}", overwrite=True, storage_options=where.options)
    return Run([mount.recorded(rec)], {"primary": {1: [content(0), content(1)]}}, {"primary": {1}})


def delta(where: Where) -> Run:
    root, watched = where.root("delta")
    mount = where.mount(watched)
    live = content(1)
    with where.recording(watched) as rec, _manager(root, where, keep=10, full_every=2,
                                                                 async_mode="double_buffer") as manager:
        manager.save(1, live)
        manager.before_step()  # step 1's snapshot is complete before the state changes (double buffer)
        live["w"][0] += 1.0  # one row changes: step 2 is a delta on step 1
        live["step"] = 2
        manager.save(2, live)
    second = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in live.items()}
    assert ckpt.read_manifest(f"{root}/{step_name(2)}", where.options).base == step_name(1)
    return Run([mount.recorded(rec)], {"primary": {1: [content(1)], 2: [second]}}, {"primary": {1, 2}})


def retention(where: Where) -> Run:
    root, watched = where.root("retention")
    mount = where.mount(watched)
    with where.recording(watched) as rec, _manager(root, where, keep=1) as manager:
        for step in (1, 2, 3):
            manager.save(step, content(step))
    return Run([mount.recorded(rec)], {"primary": {s: [content(s)] for s in (1, 2, 3)}}, {"primary": {3}})


def replication(where: Where) -> Run:
    """A local primary replicated to a replica on ``where``."""
    primary_root = where.tmp / "replicated-primary" / ROOT
    primary = Mount.local(primary_root.parent, root=ROOT)
    replica_root, watched = where.root("replica")
    replica = where.mount(watched, "replica")
    with recording(primary_root.parent) as on_primary, where.recording(watched) as on_replica, \
            _manager(str(primary_root), where, keep=10, replicas=[replica_root],
                     replica_retry_initial=0.05, replica_retry_max=0.2) as manager:
        for step in (1, 2):
            manager.save(step, content(step))
    expected = {s: [content(s)] for s in (1, 2)}
    return Run([primary.recorded(on_primary), replica.recorded(on_replica)],
               {"primary": expected, "replica": expected}, {"primary": {1, 2}, "replica": {1, 2}})


SCENARIOS = {"save": save, "overwrite": overwrite, "delta": delta, "replication": replication,
             "retention": retention}


# -- the mutation audit's four survivors (issue 22, item 16) -------------------------------------------
def _no_data_fsync(monkeypatch) -> None:
    """POSIX: a data file's close no longer fsyncs it."""
    from ckpt.storage import local

    def close(self) -> int:
        os.close(self.fd)
        self.fd = -1
        return self.size

    monkeypatch.setattr(local.LocalWriter, "close", close)


def _rename_before_manifest(monkeypatch) -> None:
    """POSIX: the attempt is renamed into place (the old copy deleted) before its manifest is written."""
    from ckpt.commit import posix
    from ckpt.format import DATA_DIR

    def finish(self, attempt, raw, referenced, *, overwrite, fence=None):
        storage, tmp = attempt.target.storage, attempt.directory
        storage.sync_dir((tmp / DATA_DIR).path)
        if fence is not None:
            fence()
        self.rename_into_place(tmp, attempt.target, overwrite=overwrite)
        storage.write_bytes((attempt.target / MANIFEST_NAME).path, raw)
        storage.sync_dir(attempt.target.path)

    monkeypatch.setattr(posix.RenameCommit, "finish", finish)


def _replica_manifest_first(monkeypatch) -> None:
    """Replication: the manifest is written on the replica before the data files are copied."""
    from ckpt.root import copy

    real = copy.copy_file

    def copy_file(source, target, name, blobs, size=None, progress=None):
        manifest = target / MANIFEST_NAME
        if not manifest.is_file():
            raw = source.root.storage.read_bytes(source.root.path, MANIFEST_NAME, 1 << 20)
            target.storage.write_bytes(manifest.path, raw)
        return real(source, target, name, blobs, size, progress)

    monkeypatch.setattr(copy, "copy_file", copy_file)


def _unreferenced_deleted_first(monkeypatch) -> None:
    """Object store: an overwrite deletes the objects only the old manifest references before the PUT
    of the new manifest."""
    from ckpt.commit import object_store

    real = object_store.ManifestLastCommit.finish

    def finish(self, attempt, raw, referenced, *, overwrite, fence=None):
        object_store._remove_unreferenced(attempt.target, referenced)
        real(self, attempt, raw, referenced, overwrite=overwrite, fence=fence)

    monkeypatch.setattr(object_store.ManifestLastCommit, "finish", finish)


MUTANTS = {  # name -> (monkeypatch, scenario, kind of mount)
    "data files never fsync'd": (_no_data_fsync, "save", "posix"),
    "POSIX rename before the manifest": (_rename_before_manifest, "overwrite", "posix"),
    "S3 replica manifest before the data": (_replica_manifest_first, "replication", "s3"),
    "S3 overwrite deletes before the manifest PUT": (_unreferenced_deleted_first, "overwrite", "s3"),
}
