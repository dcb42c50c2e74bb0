"""What ``ckpt-inspect`` reports, as data: a run's steps across its mounts, one checkpoint's summary,
and the verification of every stored byte. Nothing here prints: what a caller should be told (a
catalog ignored, a replica that cannot be listed) goes to its ``note`` callback.

* steps x mounts: the mounts (:func:`mount_list`: the root and those the caller names, never the
  catalog's) and the
  steps committed on each (:func:`listings`; both: :func:`survey`), one row per step
  (:func:`step_rows`). The states come from
  the mounts themselves (committed, or missing), merged with what the catalog knows of steps in
  flight (a :class:`~ckpt.root.replica_states.ReplicaState`: pending, copying, failed, dropped,
  refused): the mounts are the truth; the catalog is only read
  (:func:`read_catalog`: nothing when it is absent, unreadable or another primary's).
* one checkpoint: :func:`summarize` (totals, tensors, values previewed, sizes per prefix, the run
  config: a JSON-ready dict; :mod:`ckpt.inspect.step`). A diff of two: :mod:`ckpt.inspect.diff`;
  a ``.safetensors`` file or a Hugging Face directory: :mod:`ckpt.inspect.weights`.
* verify: :func:`open_manifests`, then :func:`verify_one` per checkpoint: every blob read and
  checked against its checksum (:func:`ckpt.read.source.verify_blobs`) and a delta's whole chain walked, link
  by link down to a full checkpoint, each link committed and readable on some mount and of the same
  run (:func:`chain_failures`); then :func:`compare_mounts`: each replica's manifest against the
  primary's (the same run, the same digest: a replica holds the primary's manifest bitwise); each
  failure a dict (:func:`failure`: mount, step, file, tensor, error).
"""

from __future__ import annotations

import json
import os
from typing import Callable

from ..root import Catalog, CheckpointRoot, StepInfo
from ..read.committed import is_committed, read_manifest, read_manifest_bytes
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, ForeignRunError
from ..format import MANIFEST_NAME, Manifest, unseal
from .step import prefix_sizes, preview, run_config
from ..root.claim import read_claim
from ..root.damaged import damaged_steps
from ..root.replica_states import MISSING, UNKNOWN, ReplicaState
from ..read.chain import ChainLoopError, walk
from ..read.source import verify_blobs
from ..storage import Location

Note = Callable[[str], None]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# -- mounts and the catalog ----------------------------------------------------------------------
def read_catalog(path: str | None, root: Location, *, note: Note, explicit: bool = False, quiet: bool = False
                 ) -> tuple[list[str], dict[int, StepInfo]]:
    """The catalog's mounts and steps, read only; nothing when there is none, it is unreadable, or it
    indexes another primary than ``root`` (a copied root carries its original's catalog)."""
    if path is None or not os.path.isfile(os.path.join(path, "data.mdb")):
        if explicit:
            note(f"no catalog at {path}")
        return [], {}
    try:
        with Catalog(path, readonly=True) as catalog:
            mounts, steps = catalog.mounts(), {info.step: info for info in catalog.steps()}
        if mounts and mounts[0] != root.display_name:
            if not quiet:
                note(f"catalog ignored (it indexes {mounts[0]}, not {root.display_name}); run --rebuild-catalog")
            return [], {}
        return mounts, steps
    except CheckpointError as exc:
        if not quiet:
            note(f"catalog ignored ({_one_line(exc)}); run --rebuild-catalog")
        return [], {}


def mount_list(root: Location, extra: list[Location]) -> list[tuple[str, Location]]:
    """ROOT first, then the further mounts the caller names, each once: ``(url, location)``. Never
    the catalog's mount list: the catalog is a cache anyone who can write the root can plant a mount
    in (issue 22, item 9), so it never decides where this process reads or sends requests."""
    found = {root.display_name: root}
    for location in extra:
        found.setdefault(location.display_name, location)
    return list(found.items())


def listings(mounts: list[tuple[str, Location]], *, note: Note) -> dict[str, list[int] | None]:
    """Committed steps on each mount (None: a replica that cannot be listed; ROOT's failure raises)."""
    found = {}
    for index, (url, location) in enumerate(mounts):
        try:
            found[url] = CheckpointRoot(location).committed()
        except CheckpointError as exc:
            if index == 0:
                raise
            note(f"cannot list {url} ({_one_line(exc)})")
            found[url] = None
    return found


def survey(root: Location, catalog_path: str | None, extra: list[Location], *, note: Note, explicit: bool = False
           ) -> tuple[list[tuple[str, Location]], dict[str, list[int] | None], dict[int, StepInfo]]:
    """The run at ``root`` across its mounts: ``(mounts, committed steps on each, the catalog's
    steps)`` (:func:`read_catalog`, :func:`mount_list`, :func:`listings`)."""
    catalog_mounts, catalog = read_catalog(catalog_path, root, note=note, explicit=explicit)
    mounts = mount_list(root, extra)
    others = [url for url in catalog_mounts if url not in dict(mounts)]
    if others:
        note(f"the catalog also names {', '.join(others)}; not read (a mount is listed only with --mount)")
    return mounts, listings(mounts, note=note), catalog


def step_rows(mounts, listed, catalog: dict[int, StepInfo]) -> list[dict]:
    """One row per step that some mount holds or the catalog has in flight (see the docstring)."""
    rows = []
    for step in sorted(set(catalog).union(*(set(s) for s in listed.values() if s))):
        info = catalog.get(step)
        states = {}
        for url, _location in mounts:
            recorded = info.mounts.get(url) if info else None
            if listed[url] is None:
                states[url] = UNKNOWN
            elif step in listed[url]:
                states[url] = ReplicaState.COMMITTED.value
            elif recorded is not None and recorded.state != ReplicaState.COMMITTED:
                states[url] = recorded.state.value  # any replica state, refused included
            else:
                states[url] = MISSING
        if all(state in (MISSING, ReplicaState.DELETED, UNKNOWN) for state in states.values()):
            continue
        row = {"step": step, "kind": None, "base_step": None, "bytes": None, "created": None, "mounts": states,
               "error": None}
        if info is not None and info.kind is not None:
            row.update(kind=info.kind, base_step=info.base_step, bytes=info.bytes, created=info.created)
        else:
            holder = next((loc for url, loc in mounts if listed[url] and step in listed[url]), None)
            if holder is not None:
                try:
                    manifest = read_manifest(CheckpointRoot(holder).step_path(step))
                    row.update(kind=manifest.kind, base_step=manifest.base_step, created=manifest.created,
                               bytes=stored_bytes(manifest))
                except CheckpointError as exc:
                    row.update(kind="unreadable", error=_one_line(exc))
        rows.append(row)
    return rows


def set_aside_steps(mounts) -> list[dict]:
    """``{"mount", "step", "name"}`` for each step a resume set aside on each mount (damaged on
    every mount: :mod:`ckpt.root.damaged`), a mount that cannot be listed left out."""
    found = []
    for url, location in mounts:
        try:
            found += [{"mount": url, "step": step, "name": name} for step, name in damaged_steps(location)]
        except (CheckpointError, OSError):
            continue
    return found


def stored_bytes(manifest: Manifest) -> int:
    return sum(blob.length for _key, blob in manifest.blobs())


# -- one checkpoint ------------------------------------------------------------------------------
def summarize(path: Location) -> dict:
    """The checkpoint at ``path`` described: its header, totals, each tensor (dtype, shape, chunks,
    stored and raw bytes, codecs), each value's encoding and preview, the sizes per prefix and the
    recorded run config (:mod:`ckpt.inspect.step`)."""
    manifest, raw = read_manifest_bytes(path)
    version = json.loads(raw).get("format_version")
    tensors = {}
    for key, entry in sorted(manifest.tensors.items()):
        tensors[key] = {
            "dtype": str(entry.dtype).removeprefix("torch."), "shape": list(entry.shape),
            "chunks": len(entry.chunks), "stored_bytes": sum(c.blob.length for c in entry.chunks),
            "raw_bytes": sum(c.blob.decoded_length for c in entry.chunks),
            "codecs": sorted({c.blob.codec for c in entry.chunks}),
        }
    values = {key: {"encoding": entry.encoding, "preview": preview(entry)}
              for key, entry in sorted(manifest.values.items())}
    totals = {"tensors": len(tensors), "chunks": sum(t["chunks"] for t in tensors.values()), "values": len(values),
              "stored_bytes": stored_bytes(manifest),
              "raw_bytes": sum(blob.decoded_length for _key, blob in manifest.blobs()),
              "files": len(manifest.files), "file_bytes": sum(manifest.files.values())}
    return {"path": str(path), "step": manifest.step, "kind": manifest.kind, "base_step": manifest.base_step,
            "base": manifest.base, "world_size": manifest.world_size, "created": manifest.created,
            "format_version": version, "dcp_version": manifest.dcp_version, "totals": totals,
            "tensors": tensors, "values": values, "prefixes": prefix_sizes(manifest), "config": run_config(manifest)}


# -- verify --------------------------------------------------------------------------------------
def failure(mount: str, step: int, file: str | None, tensor: str | None, exc: BaseException) -> dict:
    return {"mount": mount, "step": step, "file": file, "tensor": tensor, "error": _one_line(exc)}


def open_manifests(checkpoints: list[tuple[str, int | None, Location]], failures: tuple = (CheckpointError, OSError)
                   ) -> tuple[list[tuple[str, int, Location, Manifest]], list[dict]]:
    """``(url, step, path, manifest)`` of each ``(url, step, path)`` whose manifest reads, and a
    failure for each one whose manifest does not (the exceptions ``failures`` names)."""
    opened, found = [], []
    for url, step, path in checkpoints:
        try:
            manifest = read_manifest(path)
            opened.append((url, manifest.step if step is None else step, path, manifest))
        except failures as exc:
            found.append(failure(url, step, MANIFEST_NAME, None, exc))
    return opened, found


def verify_one(url: str, step: int, path: Location, manifest: Manifest, advance,
               roots: list[Location]) -> list[dict]:
    """Every blob of one checkpoint read and checked against its checksum (:func:`ckpt.read.source.verify_blobs`);
    a delta's whole chain must resolve (:func:`chain_failures`)."""
    found = []
    verify_blobs(path, manifest, progress=advance,
                 failed=lambda key, blob, exc: found.append(failure(url, step, blob.file, key, exc)))
    return found + chain_failures(url, step, path, manifest, roots)


def chain_failures(url: str, step: int, path: Location, manifest: Manifest, roots: list[Location]) -> list[dict]:
    """A delta's chain walked link by link down to a full checkpoint: each link committed beside the
    link before it or on one of ``roots`` (the mounts), its manifest readable, of the same run; the
    first broken link is the failure (a load could not get past it). The walk is
    :func:`ckpt.read.chain.walk`'s: a link met again is a loop, checked before the link is read."""
    read = {path.name: (manifest, path)}  # name -> (its manifest, where it was read), as the walk reaches it
    child = None  # the link whose base is being read

    def what(name: str) -> str:
        return "its base" if child is None else f"{name}, the base of its link {child},"

    try:
        for name in walk(path.name, lambda link: read[link][0].base):
            if name == path.name:
                continue
            where = read[child or path.name][1]
            found = _chain_link(name, what(name), child is None, manifest, [where.parent, path.parent, *roots])
            if not isinstance(found, tuple):
                return [failure(url, step, MANIFEST_NAME, None, found)]
            read[name], child = found, name
    except ChainLoopError as exc:  # a link met again, or one link too many
        how = "loops back into the chain" if exc.limit is None else f"makes it longer than {exc.limit} links"
        return [failure(url, step, MANIFEST_NAME, None, CorruptCheckpointError(
            f"delta chain broken: {what(exc.link)} {how}"))]
    return []


def _chain_link(name: str, what: str, first: bool, manifest: Manifest, roots: list[Location]
                ) -> tuple[Manifest, Location] | CheckpointError:
    """The link ``name`` of ``manifest``'s chain (``first``: its own base), from the first of ``roots``
    where it is committed, readable and of the same run: ``(its manifest, its location)``, or why
    there is none."""
    copies = [root / name for root in dict.fromkeys(roots) if is_committed(root / name)]
    if not copies:
        return CheckpointNotFoundError(f"delta chain broken: {what} {name if first else ''}".rstrip()
                                       + " is committed on no mount")
    error = None
    for copy in copies:
        try:
            candidate = read_manifest(copy)
        except CheckpointError as exc:
            error = error or CorruptCheckpointError(f"delta chain broken: {what} at {copy} cannot be read "
                                                    f"({_one_line(exc)})")
            continue
        if candidate.run is not None and manifest.run is not None and candidate.run != manifest.run:
            error = error or ForeignRunError(f"delta chain broken: {what} at {copy} belongs to another run "
                                             f"(run {candidate.run}; this step's is run {manifest.run})")
            continue
        return candidate, copy
    return error


def primary_run(root: Location) -> str | None:
    """The run the primary ``root`` belongs to (its ``.run`` record, :mod:`ckpt.root.claim`), or None."""
    try:
        record = read_claim(root)
    except (CheckpointError, OSError):
        return None
    return None if record is None else record["run"]


def compare_mounts(opened: list[tuple[str, int, Location, Manifest]], primary: str, root: Location) -> list[dict]:
    """Each replica's manifest against the primary's copy of the same step (``primary``: its url,
    ``root``: its location): the same run and the same digest (the replica holds the primary's
    bytes); a step the primary no longer holds must be of the primary's run (:func:`primary_run`,
    read only then) when both name one."""
    mine = {step: manifest for url, step, _path, manifest in opened if url == primary}
    found, known = [], []

    def run() -> str | None:
        if not known:
            known.append(primary_run(root))
        return known[0]

    for url, step, _path, manifest in opened:
        if url == primary:
            continue
        theirs = mine.get(step)
        if theirs is not None and manifest.to_json() != theirs.to_json():
            runs = f"run {manifest.run or 'unnamed'} vs the primary's run {theirs.run or 'unnamed'}"
            found.append(failure(url, step, MANIFEST_NAME, None, ForeignRunError(
                f"its manifest differs from the primary's copy of step {step} ({runs}; digest "
                f"{_digest(manifest)} vs {_digest(theirs)}): not a replica of it")))
        elif theirs is None and manifest.run is not None and run() not in (None, manifest.run):
            found.append(failure(url, step, MANIFEST_NAME, None, ForeignRunError(
                f"another run's checkpoint (run {manifest.run}; the primary's is run {run()})")))
    return found


def _digest(manifest: Manifest) -> str:
    return unseal(manifest.to_json())[1] or "none"
