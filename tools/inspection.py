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
import sys
import time

from ckpt import CheckpointNotFoundError, CheckpointRoot
from ckpt.committed import is_committed
from ckpt.root import Catalog, mount_id, open_catalog, open_root
from ckpt.inspection import (
    mount_list,
    open_manifests,
    read_catalog,
    step_rows,
    stored_bytes,
    summarize,
    survey,
    verify_one,
)
from ckpt.storage import Location, locate
from ckpt.units import human_bytes
from .cli import EXPECTED_FAILURES, command, fail, progress

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
def when(created: float | None) -> str:
    return "-" if not created else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def note(text: str) -> None:
    print(f"{PROG}: note: {text}", file=sys.stderr)


# -- which checkpoint ------------------------------------------------------------------------------

def print_listing(root: Location, catalog_path, mounts, rows, as_json: bool) -> None:
    urls = [url for url, _location in mounts]
    if as_json:
        print(json.dumps({"root": mount_id(root), "catalog": catalog_path, "mounts": urls, "steps": rows}, indent=2))
        return
    headers = [url if len(url) <= MAX_HEADER else f"mount {i}" for i, url in enumerate(urls, 1)]
    for i, (url, header) in enumerate(zip(urls, headers), 1):
        if header != url:
            print(f"mount {i} = {url}" + (" (primary)" if i == 1 else ""))
    body = [[r["step"], r["kind"], r["base_step"], human_bytes(r["bytes"]), when(r["created"])]
            + [r["mounts"][url] for url in urls] for r in rows]
    print(table(["step", "kind", "base", "size", "time"] + headers, body))
    if not rows:
        print(f"no committed steps under {root}")


def listing(args, root: Location, *, rebuilt: bool = False) -> int:
    open_root(root)
    catalog_path = args.catalog or Catalog.default_path(root)
    mounts, listed, catalog = survey(root, catalog_path, args.mount, note=note,
                                     explicit=args.catalog is not None and not rebuilt)
    rows = step_rows(mounts, listed, catalog)
    if not rows and not catalog and not CheckpointRoot(root).step_dirs():
        raise CheckpointNotFoundError(f"{root} is not a checkpoint root (no step directories)", path=str(root))
    print_listing(root, catalog_path if (catalog or rebuilt) else None, mounts, rows, args.json)
    return 0


def rebuild(args, root: Location) -> int:
    open_root(root)
    path = args.catalog or Catalog.default_path(root)
    catalog_mounts, _ = read_catalog(path, root, note=note, quiet=True)  # a damaged one is rebuilt from ROOT, --mount
    mounts = mount_list(root, catalog_mounts, args.mount)
    open_catalog(path, [location for _url, location in mounts], rebuild=True).close()
    if not args.json:
        print(f"catalog {path} rebuilt from {len(mounts)} mount(s)")
    return listing(args, root, rebuilt=True)


# -- verify --------------------------------------------------------------------------------------
def verify(args, target: Location) -> int:
    if is_committed(target):  # one checkpoint
        checkpoints = [(str(target.parent), None, target)]
        mounts, roots = [str(target.parent)], []
    else:
        open_root(target)
        mounts_found, listed, _ = survey(target, args.catalog or Catalog.default_path(target), args.mount, note=note,
                                         explicit=args.catalog is not None)
        checkpoints = [(url, step, CheckpointRoot(location).step_path(step))
                       for url, location in mounts_found for step in listed[url] or ()
                       if args.step is None or step == args.step]
        mounts = [url for url, _location in mounts_found if listed[url] is not None]
        roots = [location for url, location in mounts_found if listed[url] is not None]
        if not checkpoints:
            what = f"step {args.step}" if args.step is not None else "checkpoint"
            raise CheckpointNotFoundError(f"no committed {what} under {target}", path=str(target))
    opened, failures = open_manifests(checkpoints, EXPECTED_FAILURES)
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
        print(f"verified {len(steps)} steps on {len(mounts)} mounts, {total} bytes ({human_bytes(total)}), "
              f"{len(failures)} failures")
    if failures:
        first = failures[0]
        print(f"{PROG}: error: {len(failures)} verification failure(s), first: {first['mount']} step "
              f"{first['step']} {first['file']}" + (f" {first['tensor']}" if first["tensor"] else ""),
              file=sys.stderr)
        return 1
    return 0


# -- one checkpoint ------------------------------------------------------------------------------
def summary(args, path: Location) -> int:
    doc = summarize(path)
    version, totals, tensors, values = doc["format_version"], doc["totals"], doc["tensors"], doc["values"]
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    base = "-" if doc["base"] is None else f"{doc['base']} (step {doc['base_step']})"
    print(f"{path}\nstep {doc['step']}  kind {doc['kind']}  base {base}  world size {doc['world_size']}  "
          f"created {when(doc['created'])}  format version {version if version is not None else '?'}")
    print(f"{totals['tensors']} tensors in {totals['chunks']} chunks, {totals['values']} values; stored "
          f"{human_bytes(totals['stored_bytes'])} ({human_bytes(totals['raw_bytes'])} raw) in {totals['files']} data file(s)")
    if tensors:
        print()
        print(table(["tensor", "dtype", "shape", "chunks", "stored", "codecs"],
                    [[key, t["dtype"], "x".join(map(str, t["shape"])) or "()", t["chunks"], human_bytes(t["stored_bytes"]),
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


@command(PROG)
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
        if is_committed(target):
            return summary(args, target)
        return listing(args, target)
    except EXPECTED_FAILURES as exc:
        return fail(PROG, exc)


if __name__ == "__main__":
    raise SystemExit(main())
