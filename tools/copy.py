"""ckpt-copy: committed steps of a checkpoint root copied to another root, verified, manifest last.

    ckpt-copy SRC DST [--step N ...] [--read-back] [--json] [--quiet]

SRC and DST are checkpoint roots (directories or URLs: s3://bucket/run, AWS_ENDPOINT_URL etc. apply).
Every committed step of SRC whose delta chain is whole is copied (with --step, those steps and the
links of their delta chains), oldest first so that a delta's base is on DST before the delta. Each
step is copied with the engine's replication copy: every blob's checksum is checked as the bytes
stream, the data files are made durable, and the manifest is written last — a step that fails half
way is never listed on DST. A step DST already holds committed with SRC's manifest (the same digest)
is left as it is; one DST holds committed with another manifest (a step of another history, or a
damaged one) is refused (exit 1, naming both digests): delete it there first. DST is locked
for the copy like a manager locks its root: a running trainer's root is refused, and so is a DST
claimed by another run than the one whose steps are copied (a manager opening a copied root
without a claim takes the run of its newest step, so a restored root resumes as the same run).

Interrupted (Ctrl-C, or SIGTERM, which unwinds the same way), the step being copied is removed from
DST before the tool exits: nothing half-written is left, no ``step-N.tmp-*`` either.

The progress bar (on a terminal) counts the steps' data bytes as they are written, not steps.

Exit codes (tools/cli.py): 0 done, 1 a step could not be read or written (one line on stderr says
which and why), 2 bad arguments, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from ckpt import CheckpointNotFoundError, CheckpointRoot, read_manifest
from ckpt.read import listed_base, read_manifest_bytes, walk
from ckpt.root import copy_step, open_root
from ckpt.root import foreign, holds_copy, read_claim
from ckpt.units import human_bytes
from .cli import EXPECTED_FAILURES, command, doc_parser, fail, progress

PROG = "ckpt-copy"


def parser() -> argparse.ArgumentParser:
    p = doc_parser(PROG, __doc__)
    p.add_argument("src", help="the checkpoint root to copy from")
    p.add_argument("dst", help="the checkpoint root to copy to (created if missing)")
    p.add_argument("--step", type=int, action="append", help="copy this step (and its delta chain); repeatable")
    p.add_argument("--read-back", action="store_true", help="read every blob back from DST and verify it")
    p.add_argument("--json", action="store_true", help="print one JSON object: the steps copied, bytes")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def steps_to_copy(source, wanted: list[int] | None) -> list[int]:
    """``wanted`` and every base their delta chains need, or every loadable step; ascending."""
    listed = source.steps()
    if not wanted:
        return listed
    missing = sorted(set(wanted) - set(listed))
    if missing:
        raise CheckpointNotFoundError(f"{source.path} has no loadable step {', '.join(map(str, missing))} "
                                      f"(committed: {', '.join(map(str, listed)) or 'none'})", path=str(source.path))
    base_of = listed_base(source.bases(listed))
    return sorted({link for step in wanted for link in walk(step, base_of)})


def refuse_another_runs_target(source, target, steps: list[int]) -> None:
    """DST claimed by one run (``.run``, :mod:`ckpt.root.claim`) takes no steps of another: a
    resume there would refuse them, or mix two runs' histories."""
    record = read_claim(target.path)
    if record is None or not steps:
        return
    theirs = read_manifest(source.step_path(steps[-1])).run
    if theirs is not None and theirs != record["run"]:
        raise foreign(target.path, record["run"], theirs, "claimed by")


class Terminated(KeyboardInterrupt):
    """SIGTERM during a copy: unwinds like Ctrl-C, so the step being copied is removed (copy_step)."""


def _terminate(signum, frame) -> None:
    raise Terminated()


@command(PROG)
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return _copy(args)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _copy(args)
    except Terminated:
        print(f"{PROG}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def _copy(args: argparse.Namespace) -> int:
    try:
        source, target = open_root(args.src), CheckpointRoot(args.dst)
        steps = steps_to_copy(source, args.step)
        target.lock()
        copied, skipped, total = [], [], 0
        try:
            refuse_another_runs_target(source, target, steps)
            manifests = {step: read_manifest_bytes(source.step_path(step)) for step in steps}
            sizes = {step: sum(manifest.files.values()) for step, (manifest, _) in manifests.items()}
            # bytes, not steps: one step can be most of the copy (805 MB sat at 0/1 when steps were counted)
            with progress(sum(sizes.values()), "copy", quiet=args.quiet) as bar:
                for step in steps:
                    moved = bar.n
                    if holds_copy(target.step_path(step), manifests[step][1], source.step_path(step)):
                        skipped.append(step)
                    else:
                        total += copy_step(source.step_path(step), target.step_path(step), read_back=args.read_back,
                                           progress=bar.update)
                        copied.append(step)
                    bar.update(moved + sizes[step] - bar.n)  # a step already there counts as done
        finally:
            target.unlock()
    except EXPECTED_FAILURES as exc:
        return fail(PROG, exc)
    if args.json:
        print(json.dumps({"source": str(source.path), "target": str(target.path), "copied": copied,
                          "already_there": skipped, "bytes": total, "read_back": args.read_back}))
    else:
        print(f"copied {len(copied)} step(s) ({human_bytes(total)}) to {target.path}"
              + (f"; {len(skipped)} already there" if skipped else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
