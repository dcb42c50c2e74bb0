"""ckpt-inspect: list a run's steps across its mounts, verify every stored byte, or summarise one checkpoint.

    ckpt-inspect ROOT [--mount URL ...] [--catalog DIR] [--json]    steps x mounts table
    ckpt-inspect ROOT --verify [--step N] [--quiet]                 read and check every blob
    ckpt-inspect ROOT/step-N [--json]                               one manifest: totals, tensors, values
    ckpt-inspect ROOT --rebuild-catalog [--catalog DIR]             rebuild the catalog, then list

Mounts are ROOT, the catalog's mounts (``ROOT/.catalog`` by default for a local ROOT) and every
``--mount``. The listing's states come from the mounts themselves (committed, or missing), merged
with what the catalog knows of steps in flight (pending, copying, failed): the mounts are the truth;
the catalog is only read, except by --rebuild-catalog. URLs (``s3://bucket/run``) take their
endpoint and credentials from the standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).

``--json`` prints one JSON document on stdout in every mode (keys are stable). Exit codes
(tools/cli.py): 0 done (--verify: no failure), 1 a checkpoint is missing, unreadable or fails to
verify (one line on stderr says why; --verify also prints one line per failure on stdout), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ckpt import CheckpointError, CheckpointNotFoundError, commit
from ckpt.committed import MAX_MANIFEST_BYTES, read_manifest
from ckpt.format import MANIFEST_NAME, Manifest
from ckpt.read import verify_blobs
from ckpt.root import Catalog, CheckpointRoot, StepInfo, mount_id, open_catalog, open_root
from ckpt.storage import Location, locate
from tools.cli import EXPECTED_FAILURES, fail, progress

PROG = "ckpt-inspect"
MAX_HEADER = 24  # a mount URL longer than this is shown as "mount N" with a legend
EPILOG = """examples:
  ckpt-inspect ckpts/run1                                  steps, kinds, sizes, state per mount
  ckpt-inspect ckpts/run1 --mount s3://bucket/run1         ... with a replica not in the catalog
  ckpt-inspect ckpts/run1 --verify                         check every checksum on every mount
  ckpt-inspect s3://bucket/run1 --verify --step 1200       one step (AWS_ENDPOINT_URL etc. apply)
  ckpt-inspect ckpts/run1/step-00001200 --json             one checkpoint's manifest, for scripts
  ckpt-inspect ckpts/run1 --rebuild-catalog                re-index ckpts/run1/.catalog from the manifests
"""


# -- formatting ----------------------------------------------------------------------------------
def human(size: int | None) -> str:
    if size is None:
        return "-"
    if size < 1000:
        return f"{size} B"
    value = float(size)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        value /= 1000
        if value < 999.95 or unit == "PB":
            return f"{value:.1f} {unit}"


def when(created: float | None) -> str:
    return "-" if not created else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def note(text: str) -> None:
    print(f"{PROG}: note: {text}", file=sys.stderr)


# -- mounts and the catalog ----------------------------------------------------------------------
def read_catalog(path: str | None, root: Location, *, explicit: bool = False, quiet: bool = False
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
        if mounts and mounts[0] != mount_id(root):
            if not quiet:
                note(f"catalog ignored (it indexes {mounts[0]}, not {mount_id(root)}); run --rebuild-catalog")
            return [], {}
        return mounts, steps
    except CheckpointError as exc:
        if not quiet:
            note(f"catalog ignored ({' '.join(str(exc).split())}); run --rebuild-catalog")
        return [], {}


def mount_list(root: Location, catalog_mounts: list[str], extra: list[str]) -> list[tuple[str, Location]]:
    """ROOT first, then the catalog's mounts and --mount ones, each once: ``(url, location)``."""
    found = {mount_id(root): root}
    for url in catalog_mounts + extra:
        location = locate(url)
        found.setdefault(mount_id(location), location)
    return list(found.items())


def listings(mounts: list[tuple[str, Location]]) -> dict[str, list[int] | None]:
    """Committed steps on each mount (None: a replica that cannot be listed; ROOT's failure raises)."""
    found = {}
    for index, (url, location) in enumerate(mounts):
        try:
            found[url] = CheckpointRoot(location).committed()
        except CheckpointError as exc:
            if index == 0:
                raise
            note(f"cannot list {url} ({' '.join(str(exc).split())})")
            found[url] = None
    return found


def step_rows(mounts, listed, catalog: dict[int, StepInfo]) -> list[dict]:
    """One row per step that some mount holds or the catalog has in flight (see the docstring)."""
    rows = []
    for step in sorted(set(catalog).union(*(set(s) for s in listed.values() if s))):
        info = catalog.get(step)
        states = {}
        for url, _location in mounts:
            recorded = info.mounts.get(url) if info else None
            if listed[url] is None:
                states[url] = "unknown"
            elif step in listed[url]:
                states[url] = "committed"
            elif recorded is not None and recorded.state != "committed":
                states[url] = recorded.state
            else:
                states[url] = "missing"
        if all(state in ("missing", "deleted", "unknown") for state in states.values()):
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
                    row.update(kind="unreadable", error=" ".join(str(exc).split()))
        rows.append(row)
    return rows


def stored_bytes(manifest: Manifest) -> int:
    return sum(blob.length for _key, blob in manifest.blobs())


def print_listing(root: Location, catalog_path, mounts, rows, as_json: bool) -> None:
    urls = [url for url, _location in mounts]
    if as_json:
        print(json.dumps({"root": mount_id(root), "catalog": catalog_path, "mounts": urls, "steps": rows}, indent=2))
        return
    headers = [url if len(url) <= MAX_HEADER else f"mount {i}" for i, url in enumerate(urls, 1)]
    for i, (url, header) in enumerate(zip(urls, headers), 1):
        if header != url:
            print(f"mount {i} = {url}" + (" (primary)" if i == 1 else ""))
    body = [[r["step"], r["kind"], r["base_step"], human(r["bytes"]), when(r["created"])]
            + [r["mounts"][url] for url in urls] for r in rows]
    print(table(["step", "kind", "base", "size", "time"] + headers, body))
    if not rows:
        print(f"no committed steps under {root}")


def listing(args, root: Location, *, rebuilt: bool = False) -> int:
    open_root(root)
    catalog_path = args.catalog or Catalog.default_path(root)
    catalog_mounts, catalog = read_catalog(catalog_path, root, explicit=args.catalog is not None and not rebuilt)
    mounts = mount_list(root, catalog_mounts, args.mount)
    rows = step_rows(mounts, listings(mounts), catalog)
    if not rows and not catalog and not CheckpointRoot(root).step_dirs():
        raise CheckpointNotFoundError(f"{root} is not a checkpoint root (no step directories)", path=str(root))
    print_listing(root, catalog_path if (catalog or rebuilt) else None, mounts, rows, args.json)
    return 0


def rebuild(args, root: Location) -> int:
    open_root(root)
    path = args.catalog or Catalog.default_path(root)
    catalog_mounts, _ = read_catalog(path, root, quiet=True)  # a damaged one is rebuilt from ROOT and --mount
    mounts = mount_list(root, catalog_mounts, args.mount)
    open_catalog(path, [location for _url, location in mounts], rebuild=True).close()
    if not args.json:
        print(f"catalog {path} rebuilt from {len(mounts)} mount(s)")
    return listing(args, root, rebuilt=True)


# -- verify --------------------------------------------------------------------------------------
def verify(args, target: Location) -> int:
    if commit.is_committed(target):  # one checkpoint
        checkpoints = [(str(target.parent), None, target)]
        mounts, roots = [str(target.parent)], []
    else:
        open_root(target)
        catalog_mounts, _ = read_catalog(args.catalog or Catalog.default_path(target), target,
                                         explicit=args.catalog is not None)
        mounts_found = mount_list(target, catalog_mounts, args.mount)
        listed = listings(mounts_found)
        checkpoints = [(url, step, CheckpointRoot(location).step_path(step))
                       for url, location in mounts_found for step in listed[url] or ()
                       if args.step is None or step == args.step]
        mounts = [url for url, _location in mounts_found if listed[url] is not None]
        roots = [location for url, location in mounts_found if listed[url] is not None]
        if not checkpoints:
            what = f"step {args.step}" if args.step is not None else "checkpoint"
            raise CheckpointNotFoundError(f"no committed {what} under {target}", path=str(target))
    failures, opened = [], []
    for url, step, path in checkpoints:
        try:
            manifest = read_manifest(path)
            opened.append((url, manifest.step if step is None else step, path, manifest))
        except EXPECTED_FAILURES as exc:
            failures.append(failure(url, step, MANIFEST_NAME, None, exc))
    total = sum(stored_bytes(manifest) for *_rest, manifest in opened)
    with progress(total, "verify", quiet=args.quiet or args.json) as bar:
        for url, step, path, manifest in opened:
            failures += verify_one(url, step, path, manifest, bar.update, roots)
    steps = {str(path.name) if step is None else step for _url, step, path in checkpoints}
    summary = {"steps": len(steps), "mounts": len(mounts), "checkpoints": len(checkpoints), "bytes": total,
               "failures": failures, "ok": not failures}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for item in failures:
            print(f"FAILED {item['mount']} step {item['step']}: {item['file']}"
                  + (f" tensor {item['tensor']}" if item["tensor"] else "") + f": {item['error']}")
        print(f"verified {len(steps)} steps on {len(mounts)} mounts, {total} bytes ({human(total)}), "
              f"{len(failures)} failures")
    if failures:
        first = failures[0]
        print(f"{PROG}: error: {len(failures)} verification failure(s), first: {first['mount']} step "
              f"{first['step']} {first['file']}" + (f" {first['tensor']}" if first["tensor"] else ""),
              file=sys.stderr)
        return 1
    return 0


def failure(mount: str, step: int, file: str | None, tensor: str | None, exc: BaseException) -> dict:
    return {"mount": mount, "step": step, "file": file, "tensor": tensor, "error": " ".join(str(exc).split())}


def verify_one(url: str, step: int, path: Location, manifest: Manifest, advance,
               roots: list[Location]) -> list[dict]:
    """Every blob of one checkpoint read and checked against its checksum (:func:`ckpt.read.verify_blobs`);
    a delta's base must be committed beside it or, on a replica, on one of ``roots`` (the mounts)."""
    found = []
    verify_blobs(path, manifest, progress=advance,
                 failed=lambda key, blob, exc: found.append(failure(url, step, blob.file, key, exc)))
    if manifest.base is not None and not any(commit.is_committed(root / manifest.base)
                                             for root in [path.parent, *roots]):
        found.append(failure(url, step, MANIFEST_NAME, None, CheckpointNotFoundError(
            f"delta chain broken: its base {manifest.base} is committed on no mount")))
    return found


# -- one checkpoint ------------------------------------------------------------------------------
def summary(args, path: Location) -> int:
    manifest = read_manifest(path)
    try:
        raw = path.storage.read_bytes(path.path, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        version = json.loads(raw).get("format_version")
    except (ValueError, OSError, AttributeError):
        version = None
    tensors = {}
    for key, entry in sorted(manifest.tensors.items()):
        tensors[key] = {
            "dtype": str(entry.dtype).removeprefix("torch."), "shape": list(entry.shape),
            "chunks": len(entry.chunks), "stored_bytes": sum(c.blob.length for c in entry.chunks),
            "raw_bytes": sum(c.blob.decoded_length for c in entry.chunks),
            "codecs": sorted({c.blob.codec for c in entry.chunks}),
        }
    values = {key: {"encoding": entry.encoding} for key, entry in sorted(manifest.values.items())}
    totals = {"tensors": len(tensors), "chunks": sum(t["chunks"] for t in tensors.values()), "values": len(values),
              "stored_bytes": stored_bytes(manifest),
              "raw_bytes": sum(blob.decoded_length for _key, blob in manifest.blobs()),
              "files": len(manifest.files), "file_bytes": sum(manifest.files.values())}
    doc = {"path": str(path), "step": manifest.step, "kind": manifest.kind, "base_step": manifest.base_step,
           "base": manifest.base, "world_size": manifest.world_size, "created": manifest.created,
           "format_version": version, "dcp_version": manifest.dcp_version, "totals": totals,
           "tensors": tensors, "values": values}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    base = "-" if manifest.base is None else f"{manifest.base} (step {manifest.base_step})"
    print(f"{path}\nstep {manifest.step}  kind {manifest.kind}  base {base}  world size {manifest.world_size}  "
          f"created {when(manifest.created)}  format version {version if version is not None else '?'}")
    print(f"{totals['tensors']} tensors in {totals['chunks']} chunks, {totals['values']} values; stored "
          f"{human(totals['stored_bytes'])} ({human(totals['raw_bytes'])} raw) in {totals['files']} data file(s)")
    if tensors:
        print()
        print(table(["tensor", "dtype", "shape", "chunks", "stored", "codecs"],
                    [[key, t["dtype"], "x".join(map(str, t["shape"])) or "()", t["chunks"], human(t["stored_bytes"]),
                      ",".join(t["codecs"])] for key, t in tensors.items()]))
    if values:
        print()
        print(table(["value", "encoding"], [[key, v["encoding"]] for key, v in values.items()]))
    return 0


# -- entry point ---------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="a checkpoint root (directory or URL), or one checkpoint (ROOT/step-N)")
    p.add_argument("--mount", action="append", default=[], metavar="URL",
                   help="a further mount (replica) to list or verify; repeatable")
    p.add_argument("--catalog", metavar="DIR", help="the catalog directory (default ROOT/.catalog for a local ROOT)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--verify", action="store_true", help="read every blob and check its checksum")
    p.add_argument("--step", type=int, help="with --verify: only this step")
    p.add_argument("--rebuild-catalog", action="store_true", help="rebuild the catalog from the manifests, then list")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.verify and args.rebuild_catalog:
        p.error("--verify and --rebuild-catalog do not go together")
    if args.step is not None and not args.verify:
        p.error("--step goes with --verify (to summarise one step, name it: ROOT/step-N)")
    try:
        target = locate(args.root)
        if args.rebuild_catalog and args.catalog is None and not target.is_local:
            p.error(f"--rebuild-catalog: {target} is not local; say where the catalog lives with --catalog DIR")
        if args.verify:
            return verify(args, target)
        if args.rebuild_catalog:
            return rebuild(args, target)
        if commit.is_committed(target):
            return summary(args, target)
        return listing(args, target)
    except EXPECTED_FAILURES as exc:
        return fail(PROG, exc)


if __name__ == "__main__":
    raise SystemExit(main())
