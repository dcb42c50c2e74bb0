"""ckpt-replay: materialise step N of a checkpoint root (a delta chain) as a full checkpoint.

    ckpt-replay ROOT --step N [--out DIR] [--force] [--quiet] [--json]

Without --out, step N is replaced in place, atomically, by its full equivalent (later deltas that
build on it stay valid), and the root's catalog records it. An --out named as a step must be step
N's name (step 450 is never stored as step-00000400). A step ROOT does not hold committed is
refused with the steps it does hold (the newest 20). ``--json`` prints one JSON object on stdout
instead of the summary line (source, written, step, kind before, tensors, bytes, verified). Exit
codes (tools/cli.py): 0 done, 1 the checkpoint could not be read or written (one line on stderr
says why), 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json

from ckpt import CheckpointNotFoundError, CheckpointRoot, read_manifest
from ckpt.convert import materialize
from ckpt.root import record_replaced
from ckpt.storage import locate
from ckpt.units import human_bytes
from .cli import EXPECTED_FAILURES, command, doc_parser, fail, progress

PROG = "ckpt-replay"
SHOWN_STEPS = 20  # a missing step's error names at most this many committed ones (the newest)


def parser() -> argparse.ArgumentParser:
    p = doc_parser(PROG, __doc__)
    p.add_argument("root", help="checkpoint root holding step-XXXXXXXX directories")
    p.add_argument("--step", type=int, required=True, help="the step to materialise")
    p.add_argument("--out", help="write the full checkpoint here instead of replacing the step in place")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the summary line")
    return p


def committed_step(root: CheckpointRoot, step: int):
    """The directory of ``step`` under ``root``; CheckpointNotFoundError naming the committed steps
    (the newest :data:`SHOWN_STEPS`) when it is not committed there."""
    committed = root.committed()
    if step not in committed:
        shown = ", ".join(map(str, committed[-SHOWN_STEPS:])) or "none"
        more = f" (the newest {SHOWN_STEPS} of {len(committed)})" if len(committed) > SHOWN_STEPS else ""
        raise CheckpointNotFoundError(f"no checkpoint of step {step} is committed under {root.path}; "
                                      f"committed steps{more}: {shown}", path=str(root.step_path(step)))
    return root.step_path(step)


@command(PROG)
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        source = committed_step(CheckpointRoot(args.root), args.step)
        target = source if args.out is None else locate(args.out)
        manifest = read_manifest(source)
        total = sum(c.blob.decoded_length for e in manifest.tensors.values() for c in e.chunks)
        with progress(total, f"replay step {args.step}", quiet=args.quiet or args.json) as bar:
            written = materialize(source, target, overwrite=args.force, progress=bar.update)
    except EXPECTED_FAILURES as exc:
        return fail(PROG, exc, forced=args.force if args.out is not None else None)
    record_replaced(target, written)  # the catalog of the root written into stays true
    if args.json:
        print(json.dumps({"source": str(source), "written": str(target), "step": args.step,
                          "kind_before": manifest.kind, "kind": "full", "in_place": args.out is None,
                          "tensors": len(manifest.tensors), "bytes": total, "verified": "every chunk read"}))
    else:
        kind = "was already full" if manifest.kind == "full" else f"replayed from a {manifest.kind} chain"
        print(f"step {args.step} ({kind}): {len(manifest.tensors)} tensors, {human_bytes(total)} written as a "
              f"full checkpoint to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
