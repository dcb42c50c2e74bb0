"""What every ckpt CLI shares: one readable error line and the exit codes.

    0  done
    1  a checkpoint could not be read or written (the line says which and why)
    2  bad arguments (argparse's usage message)

A progress bar shows only on a terminal and is erased when the tool ends, so a failing run prints
exactly one line on stderr.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from ckpt import CheckpointError, CheckpointExistsError

EXPECTED_FAILURES = (CheckpointError, OSError)


def error_line(prog: str, exc: BaseException) -> str:
    """The one line a CLI prints for an expected failure (CLI words, not library ones)."""
    if isinstance(exc, CheckpointExistsError):
        text = f"{exc.path or 'the output'} already exists; pass --force to replace it"
    elif isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
        text = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    else:
        text = str(exc)
    return f"{prog}: error: {' '.join(text.split())}"


def fail(prog: str, exc: BaseException) -> int:
    print(error_line(prog, exc), file=sys.stderr)
    return 1


def progress(total: int, description: str, *, quiet: bool) -> tqdm:
    """A byte-count bar on stderr, shown only on a terminal and erased at the end."""
    return tqdm(total=total, unit="B", unit_scale=True, desc=description, file=sys.stderr, leave=False,
                disable=True if quiet else None)
