"""ckpt-inspect: list a run's steps across its mounts, verify every stored byte, or summarise one checkpoint.

    ckpt-inspect ROOT [--mount URL ...] [--catalog DIR] [--memory DIR] [--json]
                                                                    steps x mounts table (and the steps
                                                                    set aside as damaged on each mount),
                                                                    then the run's memory steps here
    ckpt-inspect ROOT --verify [--step N] [--quiet]                 read and check every blob
    ckpt-inspect ROOT/step-N [--json]                               one checkpoint: totals, sizes per prefix,
                                                                    tensors, values, the recorded run config
    ckpt-inspect FILE.safetensors | HF_DIR [--json]                 weights' headers: names, dtypes, shapes, sizes
    ckpt-inspect [ROOT] --diff A B [--no-values] [--json]           two checkpoints (steps of ROOT, or paths)
    ckpt-inspect ROOT --rebuild-catalog [--catalog DIR]             rebuild the catalog, then list

Mounts are ROOT and every ``--mount``; never the mounts the catalog (``ROOT/.catalog`` by default
for a local ROOT) names, which are only mentioned in a note. The listing's states come from the
mounts themselves (committed, or missing), merged with what the catalog knows of steps in flight
(pending, copying, failed, dropped, refused): the mounts are the truth; the catalog is only read, except by
--rebuild-catalog, which rebuilds it from ROOT and --mount. After the table, the memory tier's steps
of ROOT's run that this machine holds (``--memory DIR``, else the ``checkpoint.memory`` the newest step's
run config records, when it exists here: :mod:`ckpt.inspect.memory`), read only. URLs (``s3://bucket/run``) take their
endpoint and credentials from the standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).

``--json`` prints one JSON document on stdout in every mode (keys are stable). Exit codes
(tools/cli.py): 0 done (--verify: no failure), 1 a checkpoint is missing, unreadable or fails to
verify (one line on stderr says why; --verify also prints one line per failure on stdout), 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from ckpt import CheckpointNotFoundError, CheckpointRoot, read_manifest
from ckpt.read import is_committed
from ckpt.root import Catalog, open_catalog, open_root, resolve_checkpoint
from ckpt.inspect import (
    diff,
    hf_summary,
    is_hf_directory,
    is_weights_file,
    safetensors_summary,
    compare_mounts,
    memory_listing,
    mount_list,
    open_manifests,
    set_aside_steps,
    step_rows,
    stored_bytes,
    summarize,
    survey,
    verify_one,
)
from ckpt.storage import Location, locate
from ckpt.units import human_bytes
from . import inspect_views as views
from .cli import EXPECTED_FAILURES, command, fail, progress
from .inspect_views import table, when

PROG = "ckpt-inspect"
MAX_HEADER = 24  # a mount URL longer than this is shown as "mount N" with a legend
EPILOG = """examples:
  ckpt-inspect ckpts/run1                                  steps, kinds, sizes, state per mount
  ckpt-inspect ckpts/run1 --mount s3://bucket/run1         ... and its replica
  ckpt-inspect ckpts/run1 --memory /dev/shm/ckpt           ... and the run's memory steps on this node
  ckpt-inspect ckpts/run1 --verify                         check every checksum on every mount
  ckpt-inspect s3://bucket/run1 --verify --step 1200       one step (AWS_ENDPOINT_URL etc. apply)
  ckpt-inspect ckpts/run1/step-00001200 --json             one checkpoint's manifest, for scripts
  ckpt-inspect ckpts/run1 --rebuild-catalog                re-index ckpts/run1/.catalog from the manifests
  ckpt-inspect ckpts/run1 --diff 1000 1200                 what changed between two steps
  ckpt-inspect hf-out/model.safetensors                    a weights file's header (names, dtypes, shapes)
"""


# -- formatting ----------------------------------------------------------------------------------
def note(text: str) -> None:
    print(f"{PROG}: note: {text}", file=sys.stderr)


# -- which checkpoint ------------------------------------------------------------------------------

def rank_ranges(ranks: list[int] | None) -> str | None:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (None stays None: shown as ``-``)."""
    if not ranks:
        return None if ranks is None else "none"
    runs = [[ranks[0], ranks[0]]]
    for rank in ranks[1:]:
        if rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def print_memory(directory: str | None, run: str | None, rows: list[dict]) -> None:
    """The memory steps of ``run`` in ``directory`` on this machine (nothing without a directory)."""
    if directory is None or run is None:
        return
    if not rows:
        views.say(f"\nno memory steps of run {run} in {directory} on this machine")  # a recorded name: escaped
        return
    views.say(f"\nmemory steps of run {run} in {directory} on this machine:")
    body = [[r["step"], r["node"], rank_ranges(r["own"]),
             None if r["partner"] is None else rank_ranges(r["partner"])
             + ("" if r["partner_node"] is None else f" (node {r['partner_node']})"),
             human_bytes(r["bytes"])] for r in rows]
    print(table(["step", "node", "own ranks", "partner copies", "size"], body))


def print_listing(root: Location, catalog_path, mounts, rows, as_json: bool, damaged: list[dict] = (),
                  memory: tuple = (None, None, [])) -> None:
    urls = [url for url, _location in mounts]
    if as_json:
        print(json.dumps({"root": root.display_name, "catalog": catalog_path, "mounts": urls, "steps": rows,
                          "damaged": list(damaged), "memory_directory": memory[0], "memory": memory[2]}, indent=2))
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
    for entry in damaged:
        print(f"set aside, no mount could load it: step {entry['step']} as {entry['name']} on {entry['mount']}")
    print_memory(*memory)


def listing(args, root: Location, *, rebuilt: bool = False) -> int:
    open_root(root)
    catalog_path = args.catalog or Catalog.default_path(root)
    mounts, listed, catalog = survey(root, catalog_path, args.mount, note=note,
                                     explicit=args.catalog is not None and not rebuilt)
    rows = step_rows(mounts, listed, catalog)
    damaged = set_aside_steps(mounts)
    here = listed[mounts[0][0]]  # ROOT's committed steps: the newest records the run config
    newest = CheckpointRoot(root).step_path(max(here)) if here else None
    memory = memory_listing(root, newest, args.memory, note=note)
    if not rows and not catalog and not damaged and not memory[2] and not CheckpointRoot(root).step_dirs():
        raise CheckpointNotFoundError(f"{root} is not a checkpoint root (no step directories)", path=str(root))
    print_listing(root, catalog_path if (catalog or rebuilt) else None, mounts, rows, args.json, damaged, memory)
    return 0


def rebuild(args, root: Location) -> int:
    open_root(root)
    path = args.catalog or Catalog.default_path(root)
    mounts = mount_list(root, args.mount)  # ROOT and --mount: never the catalog's own list
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
    if not is_committed(target):  # every mount's copy against the primary's
        failures += compare_mounts(opened, mounts[0], target)
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


# -- one checkpoint, weights files, a diff --------------------------------------------------------
def one(args, target: Location) -> int:
    """A checkpoint of ours, a .safetensors file or a Hugging Face directory (headers only)."""
    if is_committed(target):
        views.checkpoint(summarize(target), args.json)
    elif target.is_local and is_weights_file(target.path):
        views.weights(safetensors_summary(target.path), args.json)
    elif target.is_local and is_hf_directory(target.path):
        views.weights(hf_summary(target.path), args.json)
    else:
        return listing(args, target)
    return 0


def checkpoint_named(name: str, root: str | None) -> Location:
    """``--diff`` operands: a step number of ROOT, or a checkpoint (or a root: its newest step)."""
    if name.isdigit() and root is not None:
        return resolve_checkpoint(root, int(name))
    return resolve_checkpoint(name)


def compare(args) -> int:
    a, b = (checkpoint_named(name, args.root) for name in args.diff)
    total = sum(e.dtype.itemsize * math.prod(e.shape) for e in read_manifest(b).tensors.values())
    with progress(total, "diff", quiet=args.quiet or args.json) as bar:
        doc = diff(a, b, values=not args.no_values, progress=bar.update)
    views.diff(doc, args.json)
    return 0


# -- entry point ---------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", help="a checkpoint root (directory or URL), one checkpoint (ROOT/step-N), "
                                           "a .safetensors file or a Hugging Face model directory")
    p.add_argument("--mount", action="append", default=[], metavar="URL",
                   help="a further mount (replica) to list or verify; repeatable")
    p.add_argument("--catalog", metavar="DIR", help="the catalog directory (default ROOT/.catalog for a local ROOT)")
    p.add_argument("--memory", metavar="DIR", help="the memory tier's directory on this machine, to list the run's "
                   "memory steps (default: the checkpoint.memory the newest step records, when it exists here)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--verify", action="store_true", help="read every blob and check its checksum")
    p.add_argument("--step", type=int, help="with --verify: only this step")
    p.add_argument("--rebuild-catalog", action="store_true", help="rebuild the catalog from the manifests, then list")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two checkpoints: step numbers of ROOT, or "
                   "checkpoint paths/URLs: tensors added, removed, retyped, changed (checksums first, values where "
                   "they cannot tell) and values changed")
    p.add_argument("--no-values", action="store_true", help="with --diff: judge by the manifests only, read no data")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


@command(PROG)
def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.verify and args.rebuild_catalog:
        p.error("--verify and --rebuild-catalog do not go together")
    if args.diff is not None and (args.verify or args.rebuild_catalog or args.mount or args.step is not None):
        p.error("--diff goes with none of --verify, --rebuild-catalog, --mount, --step")
    if args.memory is not None and (args.verify or args.diff is not None):
        p.error("--memory goes with the listing only (not --verify, --diff)")
    if args.no_values and args.diff is None:
        p.error("--no-values goes with --diff")
    if args.root is None and args.diff is None:
        p.error("the following arguments are required: root")
    if args.step is not None and not args.verify:
        p.error("--step goes with --verify (to summarise one step, name it: ROOT/step-N)")
    try:
        if args.diff is not None:
            return compare(args)
        target = locate(args.root)  # ROOT and each --mount resolved once, here: the library takes Locations
        args.mount = [locate(url) for url in args.mount or ()]
        if args.rebuild_catalog and args.catalog is None and not target.is_local:
            p.error(f"--rebuild-catalog: {target} is not local; say where the catalog lives with --catalog DIR")
        if args.verify:
            return verify(args, target)
        if args.rebuild_catalog:
            return rebuild(args, target)
        return one(args, target)
    except EXPECTED_FAILURES as exc:
        return fail(PROG, exc)


if __name__ == "__main__":
    raise SystemExit(main())
