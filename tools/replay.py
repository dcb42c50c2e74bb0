"""ckpt-replay: materialise step N of a checkpoint root (a delta chain) as a full checkpoint.

    ckpt-replay ROOT --step N [--out DIR] [--force]

Without --out, step N is replaced in place, atomically, by its full equivalent (later deltas that
build on it stay valid). Exit codes (tools/cli.py): 0 done, 1 the checkpoint could not be read or
written (one line on stderr says why), 2 bad arguments.
"""

from __future__ import annotations

import argparse

from ckpt import CheckpointRoot, read_manifest
from ckpt.convert import materialize
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
    source = CheckpointRoot(args.root).step_path(args.step)
    try:
        manifest = read_manifest(source)
        total = sum(c.blob.decoded_length for e in manifest.tensors.values() for c in e.chunks)
        with progress(total, f"replay step {args.step}", quiet=args.quiet) as bar:
            materialize(source, args.out, overwrite=args.force, progress=bar.update)
    except EXPECTED_FAILURES as exc:
        return fail("ckpt-replay", exc)
    kind = "was already full" if manifest.kind == "full" else f"replayed from a {manifest.kind} chain"
    print(f"step {args.step} ({kind}) written as a full checkpoint to {args.out or source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
