"""What every ckpt CLI shares: one readable error line and the exit codes, the progress bar, and the
arguments more than one tool reads.

    0    done
    1    a checkpoint could not be read or written (the line says which and why)
    2    bad arguments (argparse's usage message)
    130  interrupted (Ctrl-C: one ``interrupted`` line, no traceback; outputs appear whole or not at all)

A closed pipe on stdout (``ckpt-inspect ROOT | head``) ends the tool quietly (:func:`command`).

A progress bar shows only on a terminal and is erased when the tool ends, so a failing run prints
exactly one line on stderr. Shared arguments: ``--dtype`` names (:data:`DTYPES`), sizes
(:func:`parse_size`), the format a DST's extension implies (:func:`implied_format`), and the
checkpoint a SRC names is the engine's one resolver, :func:`ckpt.root.resolve_checkpoint`.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import select
import sys
from typing import Callable

import torch
from tqdm import tqdm

from ckpt import CheckpointError, CheckpointExistsError
from ckpt.redact import redact

EXPECTED_FAILURES = (CheckpointError, OSError)


def error_line(prog: str, exc: BaseException, *, forced: bool | None = None) -> str:
    """The one line a CLI prints for an expected failure (CLI words, not library ones).

    ``forced`` is whether the tool was given ``--force`` (None: it has no such flag). Only an output
    that merely exists, on a tool that has ``--force`` not given, gets the hint "pass --force"; an
    output refused for another reason (a root holding other steps, the source itself), or refused
    although --force was given, is reported in the library's own words."""
    if isinstance(exc, CheckpointExistsError):
        text = _LIBRARY_HINT.sub("", str(exc))
        if forced is False and _MERELY_EXISTS.search(text):
            text = f"{exc.path or text.removesuffix(' already exists')} already exists; pass --force to replace it"
    elif isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
        text = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    else:
        text = str(exc)
    return f"{prog}: error: {' '.join(redact(text).split())}"  # never a credential (issue 22, item 5)


_LIBRARY_HINT = re.compile(r";\s*pass overwrite=True to replace it")  # the library's words for --force
_MERELY_EXISTS = re.compile(r"already exists\s*$")


def fail(prog: str, exc: BaseException, *, forced: bool | None = None) -> int:
    print(error_line(prog, exc, forced=forced), file=sys.stderr)
    return 1


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def command(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a tool's ``main``: Ctrl-C prints ``PROG: interrupted`` and exits 130 (the library's
    outputs are published whole or not at all, so nothing half-written is left); a reader that
    closes stdout early (``| head``) ends the tool quietly, with status 0 as ``head`` expects."""
    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def guarded(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return INTERRUPTED
            except BrokenPipeError:
                if not _stdout_closed():
                    raise
                # Python flushes stdout again at exit: point it at /dev/null so that raises nothing.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
        return guarded
    return wrap


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() on this platform, stdout not a file
        return False


def progress(total: int, description: str, *, quiet: bool, unit: str = "B") -> tqdm:
    """A bar on stderr (bytes, or ``unit``), shown only on a terminal and erased at the end."""
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=description, file=sys.stderr, leave=False,
                disable=True if quiet else None)


# -- shared arguments ------------------------------------------------------------------------------
def doc_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A tool's parser whose help is its module docstring: the first paragraph as the description,
    the paragraphs after the synopsis as the epilog (argparse prints the usage itself)."""
    paragraphs = doc.split("\n\n")
    return argparse.ArgumentParser(prog=prog, description=paragraphs[0], epilog="\n\n".join(paragraphs[2:]),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EXTENSIONS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB`` -> 5*10**9, ``2GiB`` -> 2*2**30, ``500MB``, ``1.5G``, ``123`` (bytes)."""
    match = _SIZE.match(text)
    if not match or (match.group(3) and not match.group(2)):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)")
    number, unit, binary = float(match.group(1)), match.group(2).lower(), bool(match.group(3))
    scale = 1024 ** "kmgt".index(unit) * 1024 if binary else _UNITS[unit]
    size = int(number * scale)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a shard size must be positive: {text!r}")
    return size


def implied_format(dst: str) -> tuple[str, str | None]:
    """``(suffix, format)`` of a DST path: its lower-cased extension (``""`` without one) and the
    format it implies (:data:`EXTENSIONS`; None for any other extension)."""
    name = str(dst).rstrip("/").rsplit("/", 1)[-1]
    suffix = ("." + name.rsplit(".", 1)[1].lower()) if "." in name else ""
    return suffix, EXTENSIONS.get(suffix)
