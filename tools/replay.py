"""ckpt-replay: materialise step N of a checkpoint root (a delta chain) as a full checkpoint.

    ckpt-replay ROOT --step N [--out DIR] [--force]

Without --out, step N is replaced in place, atomically, by its full equivalent (later deltas that
build on it stay valid), and the root's catalog records it. An --out named as a step must be step
N's name (step 450 is never stored as step-00000400). Exit codes (tools/cli.py): 0 done, 1 the
checkpoint could not be read or written (one line on stderr says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse

from ckpt import CheckpointRoot, read_manifest
from ckpt.convert import materialize
from ckpt.root import record_replaced
from ckpt.storage import locate
from .cli import EXPECTED_FAILURES, command, fail, progress


@command("ckpt-replay")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckpt-replay", description=__doc__.splitlines()[0])
    parser.add_argument("root", help="checkpoint root holding step-XXXXXXXX directories")
    parser.add_argument("--step", type=int, required=True, help="the step to materialise")
    parser.add_argument("--out", help="write the full checkpoint here instead of replacing the step in place")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        source = CheckpointRoot(args.root).step_path(args.step)
        target = source if args.out is None else locate(args.out)
        manifest = read_manifest(source)
        total = sum(c.blob.decoded_length for e in manifest.tensors.values() for c in e.chunks)
        with progress(total, f"replay step {args.step}", quiet=args.quiet) as bar:
            written = materialize(source, target, overwrite=args.force, progress=bar.update)
    except EXPECTED_FAILURES as exc:
        return fail("ckpt-replay", exc)
    record_replaced(target, written)  # the catalog of the root written into stays true
    kind = "was already full" if manifest.kind == "full" else f"replayed from a {manifest.kind} chain"
    print(f"step {args.step} ({kind}) written as a full checkpoint to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
