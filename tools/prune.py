"""ckpt-prune: delete old committed steps of a checkpoint root by a retention policy, chain-aware.

    ckpt-prune ROOT --keep N [--keep-every M] [--dry-run] [--json]

The policy is the manager's (``keep``/``keep_every``): the newest N loadable steps stay, every step
that is a multiple of M stays, and so does every link of a kept step's delta chain; the newest step
is never deleted. Steps are deleted newest first (a delta before its base), each with the mount's
commit protocol (manifest first), so an interrupted prune never leaves a listed step that cannot
load — unlike ``rm -rf`` or ``aws s3 rm``. The root is locked while pruning: a running trainer's root
is refused. The catalog, when there is one, forgets the deleted steps.

Exit codes (tools/cli.py): 0 done, 1 the root could not be read or a step deleted (one line on
stderr says which and why), 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json

from ckpt.root import open_root
from ckpt.root import apply_retention, record_deleted, steps_to_delete
from .cli import EXPECTED_FAILURES, command, doc_parser, fail

PROG = "ckpt-prune"


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = doc_parser(PROG, __doc__)
    p.add_argument("root", help="checkpoint root holding step-XXXXXXXX checkpoints (directory or URL)")
    p.add_argument("--keep", type=positive, required=True, help="keep the newest N loadable steps")
    p.add_argument("--keep-every", type=positive, metavar="M", help="also keep every step that is a multiple of M")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object: the steps deleted and kept")
    return p


@command(PROG)
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        root = open_root(args.root)
        if args.dry_run:
            listed = root.steps()
            bases = root.bases(listed)
            deleted = steps_to_delete(listed, keep=args.keep, keep_every=args.keep_every,
                                      bases={s: b for s, b in bases.items() if isinstance(b, int)})
        else:
            root.lock()
            try:
                deleted = apply_retention(root, keep=args.keep, keep_every=args.keep_every)
                listed = root.steps()
            finally:
                root.unlock()
            record_deleted(root.path, deleted)
    except EXPECTED_FAILURES as exc:
        return fail(PROG, exc)
    kept = [step for step in listed if step not in deleted]
    if args.json:
        print(json.dumps({"root": str(root.path), "deleted": deleted, "kept": kept, "dry_run": args.dry_run}))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {len(deleted)} step(s){': ' + ', '.join(map(str, deleted)) if deleted else ''}; "
              f"kept {', '.join(map(str, kept)) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
